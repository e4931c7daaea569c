"""The scoring-cost model of bench/scoring_cost.py: its invariants and one case by hand (pure
numpy, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import scoring_cost as sc
from bench.scoring_cost import GPU, GPUS, MODELS, Cost, ModelConfig

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

H100 = GPUS["h100"]
SCHEDULES = ("part", "window", "server", "capture", "fused")


def test_param_counts_match_published_sizes():
    want = {
        "R1-Llama-8B": 8.03e9,
        "Qwen3-8B": 8.19e9,
        "Qwen3-14B": 14.77e9,
        "Qwen3-4B": 4.02e9,
    }
    for name, n in want.items():
        assert MODELS[name].params() == pytest.approx(n, rel=0.01), name
    assert MODELS["R1-Llama-8B"].kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2


def test_decode_step_monotone_in_batch_and_kv_length():
    m = MODELS["R1-Llama-8B"]
    b = np.arange(1, 513)
    assert np.all(np.diff(sc.decode_step(m, H100, b, b * 2000)) > 0)
    t = sc.decode_step(m, H100, 128, np.linspace(0, 4e6, 200))
    assert np.all(np.diff(t) >= 0) and t[-1] > t[0]
    assert np.all(np.diff(sc.decode_step(m, H100, np.arange(1, 300), 1e5)) >= 0)


@pytest.mark.parametrize("rho,beta", [(1e15, 1e9), (1e9, 1e15), (3e12, 2e11)])
def test_decode_step_reduces_to_the_papers_eq10(rho, beta):
    """MHA, a gated MLP with 3 D I = 8 D^2 (Eq. 10's FFN of 4D in two matrices), no vocabulary:
    Eq. 10's max(2L(12BD^2 + 2BSD) / rho, 4LBSD / beta), plus the weight read (12 L D^2 bf16
    weights) that Eq. 10 leaves out."""
    D, L = 12, 3
    tiny = ModelConfig("tiny", L, D, 1, 1, D, 8 * D // 3, 0)
    assert tiny.matmul_params() == 12 * L * D * D
    gpu = GPU("ideal", rho / 1e12, beta / 1e9, 1)
    cost = Cost(compute_eff=1.0, bw_eff=1.0)
    for B, S in [(1, 1), (4, 100), (64, 3000)]:
        got = float(sc.decode_step(tiny, gpu, B, B * S, cost))
        weights = 2 * 12 * L * D * D
        want = max(
            2 * L * (12 * B * D * D + 2 * B * S * D) / rho,
            (4 * L * B * S * D + weights) / beta,
        )
        assert got == pytest.approx(want, rel=1e-12)


def test_recompute_forward_by_hand():
    # 2 layers, hidden 4, 2 query heads and 1 KV head of dim 2, MLP 8: a layer holds
    # q + o 2 * 4 * 4, k + v 2 * 4 * 2, gate / up / down 3 * 4 * 8 = 144 weights; the forward
    # skips the last layer's o (16) and MLP (96): 176 weights.
    toy = ModelConfig("toy", 2, 4, 2, 1, 2, 8, 10)
    assert toy.layer_params() == 144 and sc.forward_params(toy) == 176
    gpu = GPU("toy", tflops=1e-9, hbm_gbs=1e-6, mem_gib=1)
    s = sc.Schedule(ops_per_layer=5, launch_us=100.0)
    cost = Cost(compute_eff=1.0, bw_eff=1.0)
    # 3 query tokens of 1 request over a context of 5: FLOPs 2 * 176 * 3 + 4 * 2 * 4 * 3 * 5
    # = 1536 at 1000 FLOP/s; bytes 176 * 2 + 5 * 16 (KV) + 2 * 3 * 4 * 2 * 2 = 528 at 1000 B/s.
    g, h = sc.recompute_forward(toy, gpu, 3, 1, 5, cost, s)
    assert float(g) == pytest.approx(1.536)
    assert float(h) == pytest.approx(2 * 5 * 100e-6)
    # memory-bound once the FLOPs are few: no tokens, nothing at all
    g0, h0 = sc.recompute_forward(toy, gpu, 0, 0, 5, cost, s)
    assert float(g0) == 0 and float(h0) == 0
    # the ridge: 1000 FLOP/s * 2 bytes / (2 * 1000 B/s) = 1 token
    assert sc.ridge_tokens(toy, gpu, cost) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["Qwen3-8B", "R1-Llama-8B"])
def test_a_recompute_forward_costs_at_least_its_weight_read(name):
    m = MODELS[name]
    tokens = np.array([1, 8, 32, 77, 185, 512, 8192])
    g, _ = sc.recompute_forward(m, H100, tokens, 1, 4096, Cost(), sc.Schedule())
    weights = sc.weight_read(m, H100)
    assert np.all(g >= weights * (1 - 1e-12))
    assert np.all(np.diff(g) >= 0)  # monotone in tokens
    # below the ridge the weight read dominates; far above it, the FLOPs do
    ridge = sc.ridge_tokens(m, H100)
    assert 150 < ridge < 250
    g_small, _ = sc.recompute_forward(m, H100, 8, 1, 0, Cost(), sc.Schedule())
    assert float(g_small) == pytest.approx(weights, rel=0.01)
    g_big, _ = sc.recompute_forward(m, H100, 8192, 1, 0, Cost(), sc.Schedule())
    assert float(g_big) > 20 * weights
    # and monotone in the context the queries attend to
    gc, _ = sc.recompute_forward(
        m, H100, 512, 1, np.array([0, 1e3, 1e4, 1e5]), Cost(), sc.Schedule()
    )
    assert np.all(np.diff(gc) > 0)


@pytest.mark.parametrize("name", ["Qwen3-8B", "R1-Llama-8B"])
def test_every_schedule_costs_more_with_more_requests(name):
    rows = [sc.estimate(MODELS[name], H100, b, context=4096) for b in (8, 32, 64, 256)]
    for k in SCHEDULES:
        steps = [r[f"{k}_step"] for r in rows]
        assert all(x > 0 for x in steps) and np.all(np.diff(steps) >= 0), (k, steps)
    decode = [r["decode"] for r in rows]
    assert np.all(np.diff(decode) > 0)


def test_scored_queries_do_not_depend_on_the_schedule():
    """Every decoded token is scored once as a query (W / (W - U) of them: the buffer's rows
    start the next window); a schedule only batches them differently."""
    s = sc.Schedule()
    for b in (16, 64, 256):
        r = sc.estimate(MODELS["Qwen3-8B"], H100, b, context=2048, s=s)
        per_step = b * s.window / s.region
        assert r["queries_per_step"] == pytest.approx(per_step)
        # part tokens on carrying steps x their share = parts per step x part size
        assert r["part_tokens"] * r["part_share"] == pytest.approx(per_step)
        assert r["window_tokens"] * r["window_share"] == pytest.approx(per_step)
        assert r["server_tokens"] * r["server_share"] == pytest.approx(per_step)


def test_what_the_schedules_trade():
    for name in ("Qwen3-8B", "R1-Llama-8B"):
        for b in (64, 256):
            r = sc.estimate(MODELS[name], H100, b)
            # the pool shared by the batch
            assert r["context"] * b == pytest.approx(sc.pool_tokens(MODELS[name], H100))
            # a part step pays a weight read; a whole window pays more per step it lands on;
            # a server due step stalls the most
            assert r["part_stall"] >= sc.weight_read(MODELS[name], H100)
            assert r["part_stall"] < r["window_stall"] < r["server_stall"]
            # capture adds no forward: cheaper per step than any recompute schedule, but its
            # ring holds W + period queries per running request
            recompute = min(r[f"{k}_step"] for k in ("part", "window", "server"))
            assert r["capture_step"] < recompute
            assert r["fused_step"] < recompute
            ring_row = (512 + 128) * MODELS[name].layers * MODELS[name].q_dim * 2
            assert r["ring_bytes"] == b * ring_row
    # 32-query parts at 64 running: memory-bound forwards, dearer per step than whole windows
    r = sc.estimate(MODELS["Qwen3-8B"], H100, 64)
    assert r["part_tokens"] < sc.ridge_tokens(MODELS["Qwen3-8B"], H100)
    assert r["part_step"] > 1.5 * r["window_step"]


def test_cli_writes_the_tables(tmp_path, capsys):
    sc.main(["--batches", "64,256", "--out", str(tmp_path)])
    text = (tmp_path / "scoring_cost.md").read_text()
    assert text.startswith("## Scoring cost on a GPU")
    assert "python -m bench.scoring_cost" in text
    assert (
        text.count("| Qwen3-8B | 64 |") == 2
        and text.count("| R1-Llama-8B | 256 |") == 2
    )
    assert (tmp_path / "run.json").exists()
    assert "| Qwen3-8B | 256 |" in capsys.readouterr().out
