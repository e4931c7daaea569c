"""``python -m bench.throughput --grid`` on one small cell (benchmark-harness layer): the plumbing
runs end to end and its figures obey the invariants that hold whatever the timing (no timed
assertion); the grid's, step-cost model's and profiler's pure parts on hand-made traces."""

from __future__ import annotations

import json
import types

import pytest
from support import run_bench

from bench import step_costs as sc
from bench import throughput_grid as grid

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration


@pytest.mark.integration
def test_grid_one_cell(tiny_llama, tmp_path):
    requests, gen = 4, 96
    run_bench(
        "throughput",
        "--grid",
        "--model",
        tiny_llama,
        "--gens",
        str(gen),
        "--pool-fractions",
        "0.5",
        "--windows",
        "32",
        "--systems",
        "vanilla",
        "kara",
        "--requests",
        str(requests),
        "--max-running",
        "8",
        "--query-source",
        "capture",
        "--out",
        str(tmp_path),
    )
    runs = {
        r["system"]: r for r in json.loads((tmp_path / "grid.json").read_text())["runs"]
    }
    assert set(runs) == {"vanilla", "kara"}
    van, kara = runs["vanilla"], runs["kara"]
    for r in runs.values():
        assert r["lengths_ok"] and r["runs"] == 1 and r["gen"] == gen
        assert r["tps_sched"] > 0 and r["tps_cpu"] > 0 and r["tps"] > 0
        assert 0 < r["mean_running"] <= r["peak_running"] <= requests
        assert r["pool"] == int(0.5 * requests * (r["prompt_len"] + gen))
    # ratios are to vanilla in the same cell
    assert (
        van["sched_ratio"] == 1.0
        and abs(kara["sched_ratio"] - kara["tps_sched"] / van["tps_sched"]) < 1e-9
    )
    # vanilla never compresses; Kara (W=32, 96 tokens) does, and its share of decode time is a fraction
    assert van["compress_share"] == 0 and van["events"] == 0
    assert kara["events"] > 0 and 0 < kara["compress_share"] < 1
    assert kara["window"] == 32
    # capture: the ring is memory beyond the pool, reported beside it; vanilla has none. Its rows
    # default to one per request that can run at once, so no window fell back to recompute.
    assert (
        van["ring_bytes"] == 0
        and kara["ring_bytes"] > 0
        and kara["pool_bytes"] > 0
        and kara["fallbacks"] == 0
    )
    assert "| kara W=32 |" in (tmp_path / "grid.md").read_text()
    # compression shortens what attention reads: mean KV rows per request below vanilla's P + G/2
    assert gen / 2 < van["mean_kv"] <= van["prompt_len"] + gen / 2
    assert 0 < kara["mean_kv"] < van["mean_kv"]
    # the wave bound: R equal requests run in waves; vanilla none, Kara's from the pool and footprints
    md = (tmp_path / "grid.md").read_text()
    assert "wave bound" in md
    # a results file says what made it, when and where
    head = md.splitlines()[:3]
    assert head[0].startswith("command: python -m bench.throughput --grid ") and head[
        2
    ].startswith("date: 20")
    assert any(
        line.startswith("machine: ") and "core" in line for line in md.splitlines()[:5]
    )
    # the run record beside it: commit, command, and each engine's settings as resolved
    run = json.loads((tmp_path / "run.json").read_text())
    assert (
        run["command"] == head[0].removeprefix("command: ")
        and len(run["git"]["commit"] or "") == 40
    )
    assert run["configs"]["kara W=32"]["kara"]["window"] == 32
    assert run["configs"]["kara W=32"]["kara"]["query_source"] == "capture"
    assert run["configs"]["vanilla"]["kara"] == {"policy": "none"}
    for label, r in (("vanilla", van), ("kara W=32", kara)):
        assert run["configs"][label]["server"]["max_total_tokens"] == r["pool"]
        assert (
            run["configs"][label]["server"]["disable_overlap_schedule"] is False
        )  # both at SGLang's defaults
    # the per-step trace: vanilla's pool holds 2-3 of the 4 requests, so some wait for admission.
    # The share of steps with a request waiting (concurrency_profile, per record) and the
    # saturated phase's steps (step_costs, per interval: one fewer record) count the same steps.
    for r in runs.values():
        n, sat = r["steps_rate"]["steps"], (r["saturated"] or {}).get("steps", 0)
        assert (
            sat - 1e-9 <= r["waiting_share"] * (n + 1)
            and r["waiting_share"] * n <= sat + 1 + 1e-9
        ), (n, sat, r)
        assert 1 <= len(r["running_by_tenth"]) <= 10
        assert all(0 < x <= r["peak_running"] for x in r["running_by_tenth"])
    assert (
        van["waiting_share"] > 0 and van["running_while_waiting"] <= van["peak_running"]
    )
    # per-step costs (bench/step_costs.py): the trace's decode steps carry every output token but the
    # prefill's first one per request (the last step has no successor record: its batch is not
    # counted), and their CPU intervals are the scheduler's CPU during the run
    for r in runs.values():
        steps = r["steps_rate"]
        assert r["retractions"] > 0 or requests * (gen - 1) - r[
            "peak_running"
        ] <= steps["tokens"] <= requests * (gen - 1)
        # scheduler_cpu_seconds is read from /proc in clock ticks (10 ms); the steps' intervals are
        # finer, so their sum may pass it by up to a tick at each end
        assert (
            0.9 * r["scheduler_cpu_seconds"]
            <= steps["cpu"]
            <= r["scheduler_cpu_seconds"] + 0.02
        )
        assert r["fit_stats"]["n"] <= steps["steps"]
    # vanilla waits for admission, so both systems have a saturated phase and its ratio is to vanilla's
    assert van["saturated"]["steps"] > 0 and van["sat_ratio"] == 1.0
    if kara["waiting_share"] > 0:
        assert (
            abs(kara["sat_ratio"] - kara["saturated"]["tps"] / van["saturated"]["tps"])
            < 1e-9
        )
    else:  # Kara's footprint admitted all four at once: no saturated phase, no ratio
        assert kara["saturated"] is None and kara["sat_ratio"] is None
    costs = (tmp_path / "costs.md").read_text()
    assert "| kara W=32 |" in costs and "at the footprint limit" in costs


def test_concurrency_profile_splits_the_admission_bound_phase_from_the_drain():
    concurrency_profile = grid.concurrency_profile
    trace = (
        [dict(running=0, waiting=4)]
        + [dict(running=8, waiting=2)] * 6
        + [dict(running=r, waiting=0) for r in (6, 4, 2, 2)]
    )
    prof = concurrency_profile(trace)
    assert (
        prof["waiting_share"] == 0.6
    )  # the idle step (nothing running) is not a decode step
    assert prof["running_while_waiting"] == 8 and prof["running_after_waiting"] == 3.5
    assert prof["running_by_tenth"] == [8, 8, 8, 8, 8, 8, 6, 4, 2, 2]
    assert concurrency_profile([]) == {}


def test_wave_bound_is_the_concurrency_of_whole_waves():
    """32 requests, pool 1/4: vanilla holds 8 (4 waves), Kara's footprint 18 (2 waves): 2.00x,
    however far the footprint limit lies above; a window as long as the output gains nothing."""
    footprint_limit, kara_peak, wave_bound = (
        grid.footprint_limit,
        grid.kara_peak,
        grid.wave_bound,
    )
    p, g, requests = 20, 512, 32
    pool = int(0.25 * requests * (p + g))
    row = dict(window=64, system="kara", prompt_len=p, gen=g, pool=pool)
    gain, n_v, n_k = wave_bound(row, requests, 0.25)
    assert (
        (n_v, n_k) == (pool // (p + g), pool // (p + kara_peak(g, 64, 0.25))) == (8, 18)
    )
    assert gain == 4 / 2 and footprint_limit(row, 0.25) > 2.3
    assert wave_bound(dict(row, window=512), requests, 0.25)[0] == 1.0
    assert wave_bound(dict(row, system="vanilla", window=None), requests, 0.25) is None


def test_spread_output_lengths():
    """--spread: lengths evenly over [G(1-S), G(1+S)], mean G, same every call; 0 keeps all G;
    a spread outside [0, 1) is refused naming the flag."""
    output_lengths = grid.output_lengths
    assert output_lengths(512, 32, 0.0) == [512] * 32
    lengths = output_lengths(512, 32, 0.5)
    assert lengths == output_lengths(
        512, 32, 0.5
    )  # fixed seed: every system gets the same workload
    assert sorted(lengths) == [round(512 * (0.5 + j / 31)) for j in range(32)]
    assert (
        min(lengths) == 256
        and max(lengths) == 768
        and abs(sum(lengths) / 32 - 512) <= 0.5
    )
    assert lengths != sorted(
        lengths
    )  # shuffled: long and short requests share every wave
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="--spread"):
            output_lengths(512, 32, bad)


def _model_trace(steps, fixed, per_request, per_row, events=()):
    """A trace whose decode steps cost exactly fixed + per_request B + per_row rows CPU-seconds; ``steps``:
    (B, rows, waiting) per step; ``events``: {step index: compression seconds added to that step}."""
    trace, cpu, kara = [], 0.0, 0.0
    events = dict(events)
    for i, (b, rows, waiting) in enumerate(steps):
        trace.append(
            dict(running=b, rows=rows, waiting=waiting, cpu=cpu, kara_seconds=kara)
        )
        cpu += fixed + per_request * b + per_row * rows + events.get(i, 0.0)
        kara += events.get(i, 0.0)
    trace.append(dict(running=0, rows=0, waiting=0, cpu=cpu, kara_seconds=kara))
    return trace


def test_step_costs_recover_the_model_and_split_a_ratio():
    """bench/step_costs.py on traces generated by a known step cost: the fit recovers it from the
    event-free, admission-free steps (jointly over two runs whose statistics add up), the saturated
    phase is the steps with a request waiting, and the model's ratio at the measured batches and rows,
    less the event share, equals the measured saturated ratio (averages of a linear cost are exact)."""
    a, b, c = 0.09, 0.008, 2e-6
    # vanilla: 4 running, rows growing, a queue for 3 waves then the last wave alone
    van = [(4, 4 * (20 + s % 500), 12 if s < 1500 else 0) for s in range(2000)]
    # kara: 13 running with short rows while requests wait, then 3 (the drain); events every 16 steps
    kara = [
        (13, 13 * (20 + s % 120), 3) if s < 500 else (3, 3 * (20 + s % 120), 0)
        for s in range(1000)
    ]
    ev = {s: 0.05 for s in range(8, 1000, 16)}
    tv, tk = _model_trace(van, a, b, c), _model_trace(kara, a, b, c, ev)
    iv_v, iv_k = sc.intervals(tv), sc.intervals(tk)
    assert len(iv_v) == 2000 and sum(iv["running"] for iv in iv_v) == 8000

    # vanilla alone never varies B: three coefficients are not determined
    assert sc.fit([sc.fit_stats(iv_v)]) is None
    model = sc.fit([sc.fit_stats(iv_v), sc.fit_stats(iv_k)])
    assert model.fixed == pytest.approx(a) and model.per_request == pytest.approx(b)
    assert model.per_row == pytest.approx(c) and model.r2 == pytest.approx(1.0)
    # event steps and the admission steps (1499 -> 1500: the queue empties; 499 -> 500) are left out
    assert model.n == 2000 + 1000 - len(ev) - 2
    # joint statistics = statistics of the concatenated intervals
    joint = sc.fit([sc.fit_stats(iv_v + iv_k)])
    assert (joint.fixed, joint.per_request, joint.n) == pytest.approx(
        (model.fixed, model.per_request, model.n)
    )

    sv, sk = sc.saturated(iv_v), sc.saturated(iv_k)
    assert (
        sv["steps"] == 1500
        and sv["running"] == 4
        and sk["steps"] == 500
        and sk["running"] == 13
    )
    assert sk["event_share"] > 0 and sv["event_share"] == 0
    measured = sk["tps"] / sv["tps"]
    parts = sc.explain(model, sv, sk, limit_running=4 * 3.0)
    assert parts["predicted"] == pytest.approx(measured, rel=1e-9)
    assert parts["concurrency"] == 13 / 4
    # concurrency alone buys less than 13/4 (a fixed cost is shared, per-request costs are not)
    assert 1 < parts["batching"] < parts["concurrency"]
    assert parts["same_batch"] > 1  # shorter rows
    assert parts["at_limit"] == pytest.approx(
        model.tps(12, sk["rows_per_request"]) / model.tps(4, sv["rows_per_request"])
    )
    # the whole run includes the drain: below the saturated ratio
    assert sc.rate(iv_k)["tps"] / sc.rate(iv_v)["tps"] < measured
    assert (
        sc.intervals([dict(running=4, waiting=0)] * 3) == []
    )  # traces recorded without a CPU clock


def test_grid_system_with_its_own_query_source():
    """``--systems kara kara:recompute``: the same policy under two query sources in one invocation
    (capture's ring is memory beside the pool, recompute's is none). The label keeps
    the source, so the two runs are separate rows of one cell; a bad source is refused."""
    args = types.SimpleNamespace(query_source="auto", retention=0.25)
    label, opts, _ = grid.system_spec("kara:recompute", 1024, 64, args, 2)
    assert label == "kara:recompute W=64" and opts["kara_query_source"] == "recompute"
    label, opts, _ = grid.system_spec("kara", 1024, 64, args, 2)
    assert label == "kara W=64" and opts["kara_query_source"] == "auto"
    label, opts, per_request = grid.system_spec("snapkv:capture", 1024, 64, args, 2)
    assert (
        opts["kara_query_source"] == "capture"
        and opts["kara_policy"] == "snapkv"
        and len(per_request) == 2
    )
    with pytest.raises(ValueError, match="kara:ring"):
        grid.system_spec("kara:ring", 1024, 64, args, 2)


def test_grid_kara_opt_reaches_every_compressing_system():
    """``--kara-opt phase=server`` (what the README's throughput figures ran: the paper's global
    schedule) goes into every compressing system's options, which sgl_kara validates as it would
    the flag; vanilla gets none; a malformed item is refused naming the flag."""
    from sgl_kara.config import KaraConfig

    args = types.SimpleNamespace(
        query_source="auto", retention=0.25, kara_opt=["phase=server", "max-seqs=8"]
    )
    for system in ("kara", "kara-buffer:recompute", "snapkv"):
        _, opts, _ = grid.system_spec(system, 512, 64, args, 2)
        assert opts["kara_phase"] == "server" and opts["kara_max_seqs"] == 8
        cfg, rest = KaraConfig.from_prefixed(opts)
        assert cfg.phase == "server" and cfg.max_seqs == 8 and rest == {}
    assert grid.system_spec("vanilla", 512, None, args, 2)[1] is None
    plain = grid.system_spec(
        "kara", 512, 64, types.SimpleNamespace(query_source="auto", retention=0.25), 2
    )[1]
    assert "kara_phase" not in plain  # without --kara-opt: sgl_kara's default
    with pytest.raises(ValueError, match="--kara-opt"):
        grid.kara_opts(["phase"])
