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
