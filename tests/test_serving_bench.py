"""bench/serving.py's pure parts (no server): the commands it runs, the figures it reads from
SGLang's bench_serving result and from the per-step trace, and what the KV pool allows at each
side's admission charge."""

from __future__ import annotations

import sys
import types

import pytest

from bench import serving

# Benchmarks and docs, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration


def test_systems_and_commands():
    assert serving.parse_system("kara") == ("kara", None)
    assert serving.parse_system("kara@HEAD~1") == ("kara", "HEAD~1")
    assert serving.parse_system("sglang@fc589ba") == ("sglang", "fc589ba")
    with pytest.raises(ValueError, match="unknown system"):
        serving.parse_system("vllm")
    cmd, env = serving.server_command("kara", None, 8192)
    assert cmd == [
        sys.executable,
        "-m",
        "sgl_kara.launch_server",
        "--max-total-tokens",
        "8192",
    ]
    assert env == {}
    preset = ("--kara-window", "256", "--kara-retention", "0.2")
    cmd, _ = serving.server_command("kara", None, 8192, preset)
    assert cmd[-4:] == list(preset) and cmd[3:5] == ["--max-total-tokens", "8192"]
    resolved = types.SimpleNamespace(
        model_path="/m",
        device="cpu",
        attention_backend="torch_native",
        dtype="float32",
        page_size=1,
        max_running_requests=16,
    )
    cmd, env = serving.server_command("sglang", resolved, 8192, preset)
    assert not any(c.startswith("--kara-") for c in cmd)  # plain SGLang takes none
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and env == {
        "KARA_CPU_KERNELS": "1"
    }
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--max-total-tokens"] == "8192"
    assert flags["--max-running-requests"] == "16"
    assert (
        flags["--model-path"] == "/m" and flags["--attention-backend"] == "torch_native"
    )
    client = serving.client_command("http://h:1", "/r.jsonl", 16, 128, 1536)
    opts = dict(zip(client[3::2], client[4::2]))
    assert client[1:3] == ["-m", "sglang.benchmark.serving"]
    assert (
        opts["--dataset-name"] == "random-ids"
    )  # random token ids: nothing downloaded
    assert (opts["--num-prompts"], opts["--random-input-len"]) == ("16", "128")
    assert (opts["--random-output-len"], opts["--random-range-ratio"]) == ("1536", "1")
    assert opts["--warmup-requests"] == "0" and opts["--output-file"] == "/r.jsonl"
    assert "--output-details" in client


def test_client_figures_read_bench_serving_and_the_longest_gap():
    result = dict(
        completed=2,
        total_output_tokens=6,
        duration=1.234,
        output_throughput=4.86,
        median_itl_ms=50.0,
        p99_itl_ms=90.0,
        median_ttft_ms=300.0,
        itls=[[0.05, 0.06], [0.04, 0.41, 0.05]],
    )
    fig = serving.client_figures(result)
    assert fig["itl_max_ms"] == 410.0 and fig["tok_s"] == 4.9
    assert (fig["itl_p50_ms"], fig["itl_p99_ms"]) == (50.0, 90.0)
    assert serving.itl_max_ms([]) == 0.0


def test_stored_results_are_gzipped_with_times_to_ten_microseconds(tmp_path):
    import gzip
    import json

    result = dict(completed=1, itls=[[0.0123456789, 0.41]], ttfts=[0.300004999])
    path = tmp_path / "kara-0.bench.jsonl"
    path.write_text('{"warm-up": 1}\n' + json.dumps(result) + "\n")
    serving.gzip_in_place(str(path), round_times=True)
    assert not path.exists()
    lines = gzip.open(str(path) + ".gz", "rt").read().splitlines()
    assert json.loads(lines[0]) == {"warm-up": 1}
    stored = json.loads(lines[1])
    assert stored["itls"] == [[0.01235, 0.41]] and stored["ttfts"] == [0.3]
    assert stored["completed"] == 1
    trace = tmp_path / "kara-0.trace.jsonl"
    trace.write_text('{"t": 0.123456789}\n')
    serving.gzip_in_place(str(trace))
    assert gzip.open(str(trace) + ".gz", "rt").read() == '{"t": 0.123456789}\n'


def _step(t, running, waiting=0, rows=None, cpu=None, kara=0.0, free=100):
    return dict(
        t=t,
        cpu=t if cpu is None else cpu,
        running=running,
        waiting=waiting,
        rows=running * 11 if rows is None else rows,
        free=free,
        kara_seconds=kara,
    )


def test_window_and_timeline():
    trace = [_step(0.0, 2)]  # warm-up, before the window
    trace += [
        _step(10.0 + i, r, w)
        for i, (r, w) in enumerate(
            [
                (4, 4),
                (4, 4),
                (8, 0),
                (8, 0),
                (8, 0),
                (0, 0),
                (6, 0),
                (6, 0),
                (2, 0),
                (2, 0),
                (2, 0),
            ]
        )
    ]
    steps = serving.window(trace, 5.0, 100.0)
    assert len(steps) == 10  # the idle record (running 0) and the warm-up are left out
    tl = serving.timeline(steps, bins=5)
    assert tl["steps"] == 10 and tl["peak_running"] == 8
    assert tl["mean_running"] == pytest.approx(50 / 10)
    assert tl["running_while_waiting"] == 4 and tl["waiting_share"] == 0.2
    # 5 equal parts of the 10 s between the first and the last step
    assert tl["by_tenth"] == [4.0, 8.0, 8.0, 6.0, 2.0]
    assert tl["admissions"] == [4, 4]  # the first batch, then who joined
    assert (
        tl["prompt"] == 10
    )  # rows per request at the first step, less its decoded token
    assert serving.timeline([]) == {}


def test_cpu_rate_counts_tokens_per_scheduler_cpu_second():
    steps = [_step(float(i), 4, cpu=0.1 * i, kara=0.01 * i) for i in range(11)]
    rate = serving.cpu_rate(steps)
    assert rate["tps"] == pytest.approx(40 / 1.0)
    assert rate["event_share"] == pytest.approx(0.1)


def test_plain_sglang_holds_four_of_the_default_workload():
    charges = serving.admission_charges(None, 133, 1536, page=1)
    assert charges == dict(new=1670, running=1669, peak=1669)
    assert serving.pool_allows(8192, charges) == dict(steady=4, admitted=4, joined=4)


def test_kara_charges_hold_eight_of_the_default_workload():
    """W 512, U 32, r 0.25, period 128: a request admitted is charged its prompt, a page and
    1536 r + (W + period)(1 - r) = 384 + 480 = 864; that is also the most it counts while it
    runs (held + growth), and its peak KV stays within it."""
    policy = serving.kara_policy(
        dict(window=512, buffer=32, retention=0.25, period=128, recent=0)
    )
    charges = serving.admission_charges(policy, 133, 1536, page=1)
    assert charges["new"] == 133 + 864 + 1
    assert charges["running"] <= charges["new"] - 1
    assert charges["peak"] <= charges["running"]
    assert serving.pool_allows(8192, charges) == dict(steady=8, admitted=8, joined=8)
    steps = serving.kara_trajectory(policy, 133, 1536)
    assert len(steps) == 1535 and steps[0]["held"] == 133
    # two windows of 480 compressed to 120 (at its tokens 640 and 1024); the last tail, 575
    # rows, is left to the end (worth_compressing)
    assert steps[-1]["held"] == 133 + 1534 - 2 * 360


def test_pool_allows_is_strict_like_sglangs_prefill_budget():
    charges = dict(new=100, running=90, peak=90)
    # 4 new requests fill 400: the fourth needs strictly less than what is left
    assert serving.pool_allows(400, charges) == dict(steady=4, admitted=3, joined=4)
    assert serving.pool_allows(401, charges)["admitted"] == 4


def test_kara_flags_reach_the_resolved_policy_and_refuse_other_flags(capsys):
    cfg, _ = serving.resolve(
        2048, ("--kara-window", "256", "--kara-period", "32", "--kara-retention", "0.2")
    )
    d = cfg.to_dict()
    assert (d["window"], d["period"], d["retention"]) == (256, 32, 0.2)
    with pytest.raises(SystemExit):
        serving.main(["--out", "/tmp/x", "--kara-flags", "--tp-size 2"])
    assert "--kara-* flags only" in capsys.readouterr().err
