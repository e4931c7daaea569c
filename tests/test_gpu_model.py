"""Fast unit tests of the GPU cost model in bench/gpu_model.py (pure numpy, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import gpu_model as gm

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

LLAMA8B, GPU = gm.MODELS["R1-Llama-8B"], gm.GPUS["rtx5090"]


def test_param_counts_match_published_sizes():
    want = {
        "R1-Llama-8B": 8.03e9,
        "Qwen3-8B": 8.19e9,
        "Qwen3-14B": 14.77e9,
        "Qwen3-4B": 4.02e9,
    }
    for name, n in want.items():
        assert gm.MODELS[name].params() == pytest.approx(n, rel=0.01), name
    assert LLAMA8B.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB per token


def test_step_time_monotone_in_batch_and_kv_length():
    for tp in (1, 4):
        b = np.arange(1, 513)
        t = gm.step_time(LLAMA8B, GPU, tp, b, b * 2000)
        assert np.all(np.diff(t) > 0)
        s = np.linspace(0, 4e6, 200)
        t = gm.step_time(LLAMA8B, GPU, tp, 128, s)
        assert np.all(np.diff(t) >= 0) and t[-1] > t[0]
        tb = gm.step_time(
            LLAMA8B, GPU, tp, np.arange(1, 300), 1e5
        )  # fixed KV, growing batch
        assert np.all(np.diff(tb) >= 0)


def test_eq10_literal_hand_computed():
    # L=2, D=4, B=3, S=5: compute 2*2*(12*3*16 + 2*3*5*4) = 2784 FLOPs; memory 4*2*3*5*4 = 480 bytes
    assert gm.eq10_tpot(2, 4, 3, 5, rho=1000.0, beta=100.0) == pytest.approx(
        4.8
    )  # memory-bound
    assert gm.eq10_tpot(2, 4, 3, 5, rho=100.0, beta=1000.0) == pytest.approx(
        27.84
    )  # compute-bound
    assert gm.eq11_throughput(2, 4, 3, 5, 1000.0, 100.0) == pytest.approx(3 / 4.8)


@pytest.mark.parametrize("rho,beta", [(1e15, 1e9), (1e9, 1e15), (3e12, 2e11)])
def test_generalised_step_time_reduces_to_eq10(rho, beta):
    # MHA, gated MLP with 3*D*I = 8*D^2 (Eq. 10's FFN = 4D with two matrices), no vocab, TP=1, no weights
    D, L = 12, 3
    tiny = gm.ModelConfig("tiny", L, D, 1, 1, D, 8 * D // 3, 0)
    gpu = gm.GPU("ideal", rho / 1e12, beta / 1e9, 1, 1, 0)
    cost = gm.Cost(compute_eff=1.0, bw_eff=1.0)
    for B, S in [(1, 1), (4, 100), (64, 3000)]:
        got = float(gm.step_time(tiny, gpu, 1, B, B * S, cost, weights=False))
        assert got == pytest.approx(gm.eq10_tpot(L, D, B, S, rho, beta), rel=1e-12)


def small_workload(n=40, seed=0):
    rng = np.random.default_rng(seed)
    gens = gm.sample_lengths(n, 600, 2000, 0.8, rng)
    prompts = rng.integers(10, 60, n)
    return prompts, gens


KARA = gm.Policy("kara", window=64, keep=22, buffer=8, period=16, max_seqs=4)


def test_sample_lengths_mean_and_cap():
    g = gm.sample_lengths(2000, 3000, 8192, 0.8, np.random.default_rng(1))
    assert g.max() <= 8192 and g.min() >= 1 and abs(g.mean() - 3000) < 5


@pytest.mark.parametrize(
    "blocks", [10_000, 120]
)  # ample memory, and tight memory with preemptions
@pytest.mark.parametrize(
    "pol",
    [
        gm.Policy("full"),
        KARA,
        gm.Policy("snapkv", snap_threshold=160, snap_budget=129, snap_window=8),
    ],
)
def test_simulation_conserves_requests_and_tokens(blocks, pol):
    prompts, gens = small_workload()
    tr = gm.simulate(prompts, gens, pol, max_running=16, total_blocks=blocks, block=16)
    assert np.array_equal(tr.gen, gens)  # every request finished, exactly its length
    assert tr.batch.sum() == gens.sum()  # one token per running request per step
    assert tr.batch.max() <= 16
    assert np.all(tr.kv <= blocks * 16)  # never more KV than the budget
    assert np.all(tr.final_kv <= prompts + gens)  # compression never adds KV
    if blocks == 120 and pol.kind == "full":
        assert tr.preemptions > 0  # the tight case exercises preemption
    if pol.kind == "full":
        assert np.array_equal(tr.final_kv, prompts + gens)


def test_kara_never_holds_more_kv_than_full():
    prompts, gens = small_workload()
    full = gm.simulate(prompts, gens, gm.Policy("full"), 16, 10_000, 16)
    kara = gm.simulate(prompts, gens, KARA, 16, 10_000, 16)
    assert np.all(kara.final_kv <= full.final_kv)
    assert np.any(kara.final_kv < full.final_kv)
    for p, g in zip(
        prompts[:8], gens[:8]
    ):  # one request alone: same schedule, so compare step by step
        f1 = gm.simulate([p], [g], gm.Policy("full"), 1, 10_000, 16)
        k1 = gm.simulate([p], [g], KARA, 1, 10_000, 16)
        assert len(f1.kv) == len(k1.kv) and np.all(k1.kv <= f1.kv)


def test_kara_compresses_per_event_limits():
    prompts, gens = small_workload()
    tr = gm.simulate(prompts, gens, KARA, 16, 10_000, 16)
    steps = np.arange(1, len(tr.ev_n) + 1)
    assert np.all(
        tr.ev_n[steps % KARA.period != 0] == 0
    )  # events only every period steps
    assert tr.ev_n.max() <= KARA.max_seqs and tr.ev_n.sum() > 0


def test_event_time_zero_without_sequences_and_grows_with_them():
    pol = gm.Policy("kara")
    t = gm.event_time(
        LLAMA8B,
        GPU,
        4,
        pol,
        np.array([0, 1, 10, 30]),
        np.array([0, 3e3, 3e4, 9e4]),
        gm.Cost(),
    )
    assert t[0] == 0 and np.all(np.diff(t) > 0)
    measured = gm.Cost(cpu_event_ms=50.0, cpu_gpu_factor=100.0)
    t2 = gm.event_time(LLAMA8B, GPU, 4, pol, np.array([10]), np.array([3e4]), measured)
    assert t2[0] == pytest.approx(t[2] + 10 * 0.5e-3)


def test_kv_budget_of_paper_setting():
    kvt = gm.kv_budget_tokens(LLAMA8B, GPU, 4, 0.5, 1.5, 256)
    assert kvt % 256 == 0 and 250_000 < kvt < 450_000
    with pytest.raises(ValueError):
        gm.kv_budget_tokens(gm.MODELS["Qwen3-14B"], GPU, 1, 0.5, 1.5, 256)


def test_main_runs_end_to_end_small(tmp_path, capsys):
    """--out writes the section to its own file (bench/RESULTS.md is edited by people) with the run
    record beside it; without --out it only prints."""
    import json

    argv = [
        "--requests",
        "40",
        "--mean-gen",
        "600",
        "--max-gen",
        "2000",
        "--batch-sizes",
        "16,64",
    ]
    gm.main(argv)
    assert "| KvLLM | 64 |" in capsys.readouterr().out and not list(tmp_path.iterdir())
    gm.main(argv + ["--out", str(tmp_path)])
    text = (tmp_path / "gpu_model.md").read_text()
    assert text.startswith("## GPU cost model") and "| KvLLM | 64 |" in text
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["notes"]["requests"] == 40 and run["notes"]["batch_sizes"] == [16, 64]
