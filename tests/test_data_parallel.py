"""``--dp-size 2``: two Kara schedulers behind one HTTP server (SGLang's DP controller, round robin).

One sgl_kara server (tiny Llama, small windows: W=16, U=4, period 4, so a 96-token answer is
compressed many times) and one vanilla ``python -m sglang.launch_server --dp-size 2`` started
before it for the reference outputs; strict memory checks on (conftest). Which replica served a
request is SGLang's own ``meta_info["dp_rank"]``; each replica's Kara counters and KV pool are in
``/server_info``'s ``internal_states`` (one per replica).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import requests
from support import Server, generated

pytestmark = [
    pytest.mark.integration,  # servers of its own (docs/TESTING.md, tiers)
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2,
        reason="--dp-size 2 needs a CPU core per replica",
    ),
]

POOL = 4096
SIZING = ["--max-total-tokens", str(POOL), "--max-running-requests", "8"]
KARA_ARGS = [
    "--kara-window",
    "16",
    "--kara-buffer",
    "4",
    "--kara-chunk-budget",
    "2",
    "--kara-max-chunk",
    "3",
    "--kara-period",
    "4",
    "--kara-retention",
    "0.25",
    "--enable-metrics",
]
PROMPTS = [
    "Hello world",
    "The answer is",
    "Let x = 3. Let y = x + 4, so y = 7. Then z",
    "Once upon a time",
    "A B C D E F",
    "Numbers: 1 2 3 4 5",
    "The server said",
    "Why is the sky",
]
GEN = 96
GREEDY = {"max_new_tokens": GEN, "temperature": 0.0, "ignore_eos": True}
ANSWERED: list[
    dict
] = []  # meta_info of every response the Kara server gave (for the /metrics sum)


def generate_batch(server, texts, params) -> list[dict]:
    """One /generate with a list of prompts: the DP controller dispatches them one by one."""
    return generated(server, texts, params)


@pytest.fixture(scope="module")
def vanilla_texts(tiny_llama):
    from sgl_kara.cpu._sglang import get_cpu_ids_by_node
    from sgl_kara.cpu.cores import THREADS_BIND_VAR, split_cores
    from sgl_kara.cpu.server import cpu_defaults

    cpu = [f"--{k.replace('_', '-')}={v}" for k, v in cpu_defaults().items()]
    # plain SGLang's launcher: sgl_kara's plugin loads but applies only RoPE's CPU path there
    # (tests/test_plain_sglang.py)
    srv = Server(
        [
            "--host",
            "127.0.0.1",
            "--model-path",
            tiny_llama,
            "--dp-size",
            "2",
            *cpu,
            *SIZING,
        ],
        env={THREADS_BIND_VAR: split_cores(get_cpu_ids_by_node(), 2) or "all"},
        module="sglang.launch_server",
    )
    try:
        outs = generate_batch(srv, PROMPTS, GREEDY)
    finally:
        srv.stop()
    assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
    return [o["text"] for o in outs]


@pytest.fixture(scope="module")
def server_args(vanilla_texts, tiny_llama):
    """The module's server (conftest ``server``), started after the vanilla reference has stopped."""
    return {
        "args": [
            "--model-path",
            tiny_llama,
            "--host",
            "127.0.0.1",
            "--dp-size",
            "2",
            *SIZING,
            *KARA_ARGS,
        ]
    }


def replicas(server) -> list[dict]:
    states = requests.get(server.url + "/server_info", timeout=30).json()[
        "internal_states"
    ]
    return sorted((s["kara"] for s in states), key=lambda k: k["dp_rank"])


def test_launcher_binds_one_core_group_per_replica(server):
    """The launcher's CPU default: SGLANG_CPU_OMP_THREADS_BIND split over the two replicas (SGLang
    refuses two ranks on one NUMA node without it), each scheduler bound to its own group."""
    from sgl_kara.cpu._sglang import get_cpu_ids_by_node
    from sgl_kara.cpu.cores import THREADS_BIND_VAR, split_cores

    groups = (
        os.environ.get(THREADS_BIND_VAR) or split_cores(get_cpu_ids_by_node(), 2)
    ).split("|")
    log = server.log_text()
    for rank, group in enumerate(groups):
        assert (
            f"DP{rank}] init_threads_binding: numa_index={rank}, world_size=2, local_omp_cpuid={group}\n"
            in log
        )
    assert [r["dp_rank"] for r in replicas(server)] == [0, 1]


def test_both_replicas_compress(server):
    outs = generate_batch(server, PROMPTS, GREEDY)
    ANSWERED.extend(o["meta_info"] for o in outs)
    assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
    for o in outs:
        meta = o["meta_info"]
        assert meta["completion_tokens"] == GEN
        kara = meta["kara"]
        # W=16: a window is compressed once 16 uncompressed tokens stand past the last one.
        assert kara["compressions"] >= 5, kara
        assert kara["kv_logical_len"] == meta["prompt_tokens"] + GEN - 1
        assert kara["kv_physical_len"] < kara["kv_logical_len"] // 2, kara
    for rep in replicas(server):
        assert rep["events"] > 0 and rep["requests_compressed"] > 0, rep


def test_full_retention_matches_vanilla_dp2(server, vanilla_texts):
    """Per-request retention 1.0 reaches whichever replica serves the request: every window goes
    through scoring and fresh-slot compaction, nothing is dropped, tokens equal vanilla's."""
    params = {**GREEDY, "custom_params": {"kara": {"retention": 1.0}}}
    outs = generate_batch(server, PROMPTS, params)
    ANSWERED.extend(o["meta_info"] for o in outs)
    assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
    for o, ref in zip(outs, vanilla_texts):
        kara = o["meta_info"]["kara"]
        assert (
            kara["compressions"] >= 4
            and kara["kv_physical_len"] == kara["kv_logical_len"]
        ), kara
        assert o["text"] == ref


def test_per_request_options_on_both_replicas(server):
    options = [
        {"enable": False},
        {"enable": False},
        {"retention": 0.5},
        {"retention": 0.5},
    ]
    params = [{**GREEDY, "custom_params": {"kara": opt}} for opt in options]
    outs = generate_batch(server, ["Let x = 3."] * 4, params)
    ANSWERED.extend(o["meta_info"] for o in outs)
    off = [o["meta_info"] for o in outs[:2]]
    half = [o["meta_info"] for o in outs[2:]]
    assert {m["dp_rank"] for m in off} == {0, 1} and {m["dp_rank"] for m in half} == {
        0,
        1,
    }
    for m in off:
        assert (
            m["kara"]["compressions"] == 0
            and m["kara"]["kv_physical_len"] == m["kara"]["kv_logical_len"]
        )
    for m in half:
        kara = m["kara"]
        assert kara["compressions"] >= 4, kara
        # retention 0.5 keeps twice what the server's 0.25 keeps, still far below the logical length
        assert (
            kara["kv_logical_len"] * 0.4
            < kara["kv_physical_len"]
            < kara["kv_logical_len"] * 0.8
        ), kara
    assert half[0]["kara"]["kv_physical_len"] == half[1]["kara"]["kv_physical_len"]


def test_metrics_sum_over_replicas(server):
    """prometheus multiprocess: Kara's counters are summed over the two scheduler processes;
    the sum equals what the responses report and what each replica counted."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    values = {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("sglang:kara_") and not line.startswith("#")
    }
    reps = replicas(server)
    dropped = sum(
        m["kara"]["kv_logical_len"] - m["kara"]["kv_physical_len"] for m in ANSWERED
    )
    windows = sum(m["kara"]["compressions"] for m in ANSWERED)
    assert dropped > 0 and all(r["tokens_dropped"] > 0 for r in reps), reps
    assert (
        values["sglang:kara_tokens_dropped_total"]
        == dropped
        == sum(r["tokens_dropped"] for r in reps)
    )
    assert (
        values["sglang:kara_requests_compressed_total"]
        == windows
        == sum(r["requests_compressed"] for r in reps)
    )
    assert values["sglang:kara_events_total"] == sum(r["events"] for r in reps)


def _stream_and_abort(server, rid: str, dp_rank: int, abort_after: int) -> dict:
    body = {
        "rid": rid,
        "text": f"Let x = {rid}. Then",
        "stream": True,
        "routed_dp_rank": dp_rank,
        "sampling_params": {
            "max_new_tokens": 2000,
            "temperature": 0.7,
            "ignore_eos": True,
        },
    }
    r = requests.post(server.url + "/generate", json=body, stream=True, timeout=300)
    assert r.status_code == 200, r.text
    chunks, last = 0, None
    for line in r.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        last = json.loads(line[len(b"data: ") :])
        chunks += 1
        if chunks == abort_after:
            requests.post(
                server.url + "/abort_request", json={"rid": rid}, timeout=30
            ).raise_for_status()
    return last


def test_aborted_requests_lose_nothing(server):
    """A request aborted on each replica after its KV was compressed: once idle and flushed,
    every replica's pool is whole again (SGLang's strict idle check would have failed first)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        lasts = list(
            pool.map(lambda i: _stream_and_abort(server, f"abort-{i}", i, 60), range(2))
        )
    for i, last in enumerate(lasts):
        meta = last["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["dp_rank"] == i, meta
        assert meta["kara"]["compressions"] > 0, meta
    deadline = time.time() + 60
    while requests.post(server.url + "/flush_cache", timeout=30).status_code != 200:
        assert time.time() < deadline, "flush_cache still refused"
        time.sleep(0.5)
    for rep in replicas(server):
        assert (
            rep["free_slots"] == rep["pool_slots"] == POOL
            and rep["evictable_slots"] == 0
        ), rep
        assert rep["failed_requests"] == 0, rep
    assert server.proc.poll() is None
    # EOS ignored: the tiny model samples its EOS id now and then, which would end an answer early
    ok = generate_batch(
        server,
        ["Hello", "Hello"],
        {"max_new_tokens": 4, "temperature": 0.7, "ignore_eos": True},
    )
    assert [
        (o["meta_info"]["completion_tokens"], o["meta_info"]["finish_reason"]["type"])
        for o in ok
    ] == [(4, "length")] * 2, [o["meta_info"] for o in ok]
    bad = [
        line
        for line in server.log_text().splitlines()
        if "leak" in line.lower() or "Traceback" in line
    ]
    assert not bad, bad[:5]
