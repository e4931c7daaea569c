"""bench/throughput.py --grid on one small cell (benchmark-harness layer): the plumbing runs end to
end and its figures obey the invariants that hold whatever the timing (no timed assertion)."""

from __future__ import annotations

import json

from conftest import run_bench


def test_grid_one_cell(tiny_llama, tmp_path):
    requests, gen = 4, 96
    run_bench("throughput.py", "--grid", "--model", tiny_llama, "--gens", str(gen), "--pool-fractions", "0.5",
              "--windows", "32", "--systems", "vanilla", "kara", "--requests", str(requests), "--max-running", "8",
              "--query-source", "capture", "--out", str(tmp_path))
    runs = {r["system"]: r for r in json.loads((tmp_path / "grid.json").read_text())["runs"]}
    assert set(runs) == {"vanilla", "kara"}
    van, kara = runs["vanilla"], runs["kara"]
    for r in runs.values():
        assert r["lengths_ok"] and r["runs"] == 1 and r["gen"] == gen
        assert r["tps_sched"] > 0 and r["tps_cpu"] > 0 and r["tps"] > 0
        assert 0 < r["mean_running"] <= r["peak_running"] <= requests
        assert r["pool"] == int(0.5 * requests * (r["prompt_len"] + gen))
    # ratios are to vanilla in the same cell
    assert van["sched_ratio"] == 1.0 and abs(kara["sched_ratio"] - kara["tps_sched"] / van["tps_sched"]) < 1e-9
    # vanilla never compresses; Kara (W=32, 96 tokens) does, and its share of decode time is a fraction
    assert van["compress_share"] == 0 and van["events"] == 0
    assert kara["events"] > 0 and 0 < kara["compress_share"] < 1
    assert kara["window"] == 32
    # capture: the ring is memory beyond the pool, reported beside it; vanilla has none
    assert van["ring_bytes"] == 0 and kara["ring_bytes"] > 0 and kara["pool_bytes"] > 0 and kara["fallbacks"] >= 0
    assert "| kara W=32 |" in (tmp_path / "grid.md").read_text()
    # compression shortens what attention reads: mean KV rows per request below vanilla's P + G/2
    assert gen / 2 < van["mean_kv"] <= van["prompt_len"] + gen / 2
    assert 0 < kara["mean_kv"] < van["mean_kv"]
    # the wave bound: R equal requests run in waves; vanilla none, Kara's from the pool and footprints
    md = (tmp_path / "grid.md").read_text()
    assert "wave bound" in md
    # the per-step trace: vanilla's pool holds 2-3 of the 4 requests, so some wait for admission
    for r in runs.values():
        assert 0 <= r["waiting_share"] <= 1 and 1 <= len(r["running_by_tenth"]) <= 10
        assert all(0 < x <= r["peak_running"] for x in r["running_by_tenth"])
    assert van["waiting_share"] > 0 and van["running_while_waiting"] <= van["peak_running"]


def test_concurrency_profile_splits_the_admission_bound_phase_from_the_drain():
    import sys

    sys.path.insert(0, "bench")
    from throughput_grid import concurrency_profile

    trace = [dict(running=0, waiting=4)] + [dict(running=8, waiting=2)] * 6 + [dict(running=r, waiting=0)
                                                                               for r in (6, 4, 2, 2)]
    prof = concurrency_profile(trace)
    assert prof["waiting_share"] == 0.6  # the idle step (nothing running) is not a decode step
    assert prof["running_while_waiting"] == 8 and prof["running_after_waiting"] == 3.5
    assert prof["running_by_tenth"] == [8, 8, 8, 8, 8, 8, 6, 4, 2, 2]
    assert concurrency_profile([]) == {}


def test_wave_bound_is_the_concurrency_of_whole_waves():
    """32 requests, pool 1/4: vanilla holds 8 (4 waves), Kara's footprint 18 (2 waves): 2.00x,
    however far the footprint limit lies above; a window as long as the output gains nothing."""
    import sys

    sys.path.insert(0, "bench")
    from throughput_grid import footprint_limit, kara_peak, wave_bound

    p, g, requests = 20, 512, 32
    pool = int(0.25 * requests * (p + g))
    row = dict(window=64, system="kara", prompt_len=p, gen=g, pool=pool)
    gain, n_v, n_k = wave_bound(row, requests, 0.25)
    assert (n_v, n_k) == (pool // (p + g), pool // (p + kara_peak(g, 64, 0.25))) == (8, 18)
    assert gain == 4 / 2 and footprint_limit(row, 0.25) > 2.3
    assert wave_bound(dict(row, window=512), requests, 0.25)[0] == 1.0
    assert wave_bound(dict(row, system="vanilla", window=None), requests, 0.25) is None


def test_spread_output_lengths():
    """--spread: lengths evenly over [G(1-S), G(1+S)], mean G, same every call; 0 keeps all G;
    a spread outside [0, 1) is refused naming the flag."""
    import sys

    import pytest

    sys.path.insert(0, "bench")
    from throughput_grid import output_lengths

    assert output_lengths(512, 32, 0.0) == [512] * 32
    lengths = output_lengths(512, 32, 0.5)
    assert lengths == output_lengths(512, 32, 0.5)  # fixed seed: every system gets the same workload
    assert sorted(lengths) == [round(512 * (0.5 + j / 31)) for j in range(32)]
    assert min(lengths) == 256 and max(lengths) == 768 and abs(sum(lengths) / 32 - 512) <= 0.5
    assert lengths != sorted(lengths)  # shuffled: long and short requests share every wave
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="--spread"):
            output_lengths(512, 32, bad)


def test_profile_scheduler_options_drive_the_grid_runner(tiny_llama):
    """bench/profile_scheduler.py hands its own namespace to the grid's runner; every option that
    runner reads must exist there (it lacked --spread and crashed before sampling anything)."""
    import sys

    sys.path.insert(0, "bench")
    import profile_scheduler
    import throughput_grid as grid
    from throughput import RunResult

    args = profile_scheduler.build_parser().parse_args(["--out", "unused", "--requests", "4", "--gen", "40",
                                                        "--spread", "0.5", "--window", "32"])
    args.model_path = tiny_llama
    label, opts, per_request = grid.system_spec(args.system, args.gen, args.window, args, args.requests)
    seen = {}

    def run_system(system, a, pool, max_running, kara=None, prompts_params=None, label=None):
        seen.update(system=system, pool=pool, max_running=max_running, kara=kara, params=prompts_params[1])
        trace = [dict(running=4, waiting=0, kara_events=0, kara_seconds=0.0)]
        return RunResult(system=label, pool=pool, max_running=max_running, seconds=1.0, output_tokens=160,
                         lengths_ok=True, retractions=0, mean_running=4.0, peak_running=4, events=0,
                         compress_seconds=0.0, trace=trace, cpu_seconds=2.0, scheduler_cpu_seconds=1.0)

    r = grid.run_one(run_system, args, grid.grid_prompts(4), args.gen, 500, label, opts, per_request)
    assert seen["system"] == "kara" and seen["kara"]["kara_window"] == 32 and seen["max_running"] == 256
    lengths = [p["max_new_tokens"] for p in seen["params"]]
    assert lengths == grid.output_lengths(40, 4, 0.5) and sorted(lengths) == [20, 33, 47, 60]  # --spread 0.5
    assert r["tps_sched"] == 160.0 and r["waiting_share"] == 0 and r["running_by_tenth"] == [4.0]
