"""Reliability: retraction storm, bad input over HTTP, faults, bounded load.

One HTTP server (the reasoning proxy model, small Kara windows so every request longer than ~50
tokens is compressed several times, fault injection armed for rids starting with ``faulty``,
integrity checks on) is shared by the HTTP tests; SGLang's strict memory checks are on
(conftest). After each fault the server must still serve, ``/flush_cache`` must succeed (no
request left holding slots) and the log must show no ``leak`` and no ``Traceback``. The kill -9
test restarts the shared server on the same port, so tests after it use the restarted one.

Figures: run with ``-s`` to see the ``RELIABILITY`` lines (counts, durations) docs/RELIABILITY.md
quotes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from support import (
    PROXY_MODEL,
    Server,
    engine_env,
    flush_when_idle,
    generate,
    start_engine,
)

pytestmark = pytest.mark.integration  # a server of its own (docs/TESTING.md, tiers)

# W=40, U=8 -> 32 compressible rows per window, K = ceil(0.25 * 32) = 8 kept, 24 dropped.
KARA_ARGS = [
    "--kara-window",
    "40",
    "--kara-buffer",
    "8",
    "--kara-chunk-budget",
    "4",
    "--kara-max-chunk",
    "6",
    "--kara-period",
    "4",
    "--kara-retention",
    "0.25",
]
SERVER_ARGS = KARA_ARGS + [
    "--model-path",
    PROXY_MODEL,
    "--max-total-tokens",
    "40000",
    "--max-running-requests",
    "96",
    "--context-length",
    "2048",
]
SERVER_ENV = {"KARA_INJECT_FAULT_RID_PREFIX": "faulty", "KARA_CHECK_INTEGRITY": "1"}
DROPPED_PER_EVENT = 24


def report(what: str, **figures) -> None:
    print(f"\nRELIABILITY {what}: " + json.dumps(figures, sort_keys=True), flush=True)


@pytest.fixture(scope="module")
def server_args():
    """The module's server (conftest ``server``): the proxy, integrity checks, an injectable fault."""
    return {"args": SERVER_ARGS, "env": SERVER_ENV}


# ------------------------------------------------------------------ helpers
def post(server, body, path="/generate", timeout=300, **kw):
    return requests.post(server.url + path, json=body, timeout=timeout, **kw)


def sampled(server, text, n_tokens, rid=None, custom=None, timeout=300, **params):
    """Exactly ``n_tokens`` sampled tokens (temperature 0.7): the raw response."""
    sp = {
        "max_new_tokens": n_tokens,
        "min_new_tokens": n_tokens,
        "temperature": 0.7,
        **params,
    }
    return generate(server, text, sp, custom, rid=rid, timeout=timeout)


def assert_serving(server):
    r = sampled(server, "Hello", 1, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1


def bad_log_lines(server) -> list[str]:
    return [
        line
        for line in server.log_text().splitlines()
        if "leak" in line.lower() or "Traceback" in line or "Kara integrity" in line
    ]


def assert_clean(server, within: float = 60.0):
    """Nothing running or leaked: flush_cache succeeds (it refuses while requests run), the
    strict idle check has not fired, the scheduler still serves, the log shows no leak."""
    deadline = time.time() + within
    while True:
        r = requests.post(server.url + "/flush_cache", timeout=30)
        if r.status_code == 200:
            break
        assert time.time() < deadline, (
            f"flush_cache still refused after {within}s: {r.status_code} {r.text}"
        )
        time.sleep(0.5)
    assert server.proc.poll() is None, "server died"
    assert_serving(server)
    assert not bad_log_lines(server), bad_log_lines(server)[:5]


def stream(server, rid, n_tokens, close_after=None, abort_after=None, text=None):
    """Streaming /generate. close_after: drop the connection after that many chunks;
    abort_after: POST /abort_request for this rid after that many chunks, keep reading.
    Returns (chunks, last chunk dict or None, closed)."""
    body = {
        "rid": rid,
        "text": text or f"Let x = {rid}. Then",
        "stream": True,
        "sampling_params": {
            "max_new_tokens": n_tokens,
            "min_new_tokens": n_tokens,
            "temperature": 0.7,
        },
    }
    r = requests.post(server.url + "/generate", json=body, stream=True, timeout=300)
    assert r.status_code == 200, r.text
    chunks, last = 0, None
    for line in r.iter_lines():
        if not line:
            continue
        if line == b"data: [DONE]":
            break
        last = json.loads(line[len(b"data: ") :])
        chunks += 1
        if close_after is not None and chunks >= close_after:
            r.close()
            return chunks, last, True
        if abort_after is not None and chunks == abort_after:
            a = requests.post(
                server.url + "/abort_request", json={"rid": rid}, timeout=30
            )
            assert a.status_code == 200, a.text
    return chunks, last, False


# ------------------------------------------------------------------ item 3: bad input over HTTP
def _kara(opts):
    return {
        "text": "Hi",
        "sampling_params": {"max_new_tokens": 4, "custom_params": {"kara": opts}},
    }


BAD_JSON_BODIES = [
    # (id, body dict, expected status, substring of the error)
    (
        "retention-negative",
        _kara({"retention": -0.5}),
        400,
        "retention must be a number in (0, 1]",
    ),
    (
        "retention-zero",
        _kara({"retention": 0}),
        400,
        "retention must be a number in (0, 1]",
    ),
    (
        "retention-huge",
        _kara({"retention": 1e308}),
        400,
        "retention must be a number in (0, 1]",
    ),
    (
        "retention-just-above-1",
        _kara({"retention": 1.0000001}),
        400,
        "retention must be a number in (0, 1]",
    ),
    ("retention-null", _kara({"retention": None}), 400, "retention"),
    ("retention-list", _kara({"retention": [0.5]}), 400, "retention"),
    ("retention-bool", _kara({"retention": True}), 400, "retention"),
    ("retention-object", _kara({"retention": {"value": 0.5}}), 400, "retention"),
    ("enable-int", _kara({"enable": 1}), 400, "enable must be a bool"),
    ("enable-null", _kara({"enable": None}), 400, "enable must be a bool"),
    ("enable-string-false", _kara({"enable": "false"}), 400, "enable must be a bool"),
    (
        "kara-list",
        _kara([{"enable": False}]),
        400,
        "custom_params.kara must be an object",
    ),
    ("kara-string", _kara("off"), 400, "custom_params.kara must be an object"),
    ("kara-null", _kara(None), 400, "custom_params.kara must be an object"),
    ("unknown-field-window", _kara({"window": 64}), 400, "unknown field"),
    ("budget-wrong-type", _kara({"budget": "big"}), 400, "budget"),
    ("budget-under-policy-kara", _kara({"budget": 100}), 400, "budget"),
    (
        "disabled-with-retention",
        _kara({"enable": False, "retention": 0.5}),
        400,
        "retention",
    ),
    (
        "max-new-tokens-negative",
        {"text": "Hi", "sampling_params": {"max_new_tokens": -1}},
        400,
        "max_new_tokens must be at least 0",
    ),
    (
        "max-new-tokens-beyond-context",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 100_000_000}},
        400,
        "maximum context length of 2048",
    ),
    (
        "max-new-tokens-float-huge",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 1e30}},
        400,
        "expected i64",
    ),
    (
        "max-new-tokens-2^70",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 2**70}},
        400,
        "expected i64",
    ),
    (
        "max-new-tokens-string",
        {"text": "Hi", "sampling_params": {"max_new_tokens": "ten"}},
        400,
        "expected i64",
    ),
    (
        "min-above-max",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 8}},
        400,
        "min_new_tokens must be in [0, max_new_tokens(4)]",
    ),
    (
        "temperature-negative",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": -1}},
        400,
        "temperature must be a non-negative",
    ),
    (
        "sampling-params-string",
        {"text": "Hi", "sampling_params": "fast"},
        400,
        "sampling_params",
    ),
    (
        "no-prompt",
        {"sampling_params": {"max_new_tokens": 4}},
        400,
        "Either text, input_ids or input_embeds",
    ),
    ("body-is-list", [1, 2, 3], 400, "Input should be a dictionary"),
    (
        "prompt-text-beyond-context",
        {
            "text": "Let x = 3 and y = 4. " * 2000,
            "sampling_params": {"max_new_tokens": 4},
        },
        400,
        "longer than the model's context length (2048 tokens)",
    ),
    (
        "prompt-ids-beyond-context",
        {"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4}},
        400,
        "The input (5000 tokens) is longer than the model's context length (2048 tokens)",
    ),
    (
        "prompt-plus-output-beyond-context",
        {"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 100}},
        400,
        "maximum context length of 2048",
    ),
    (
        "beam-search",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "beam_width": 2}},
        400,
        "beam_width=2 (beam search) is not supported with --kara-policy kara",
    ),
    # Upstream SGLang 0.5.23 lets these through and its scheduler crashes (index out of range in
    # the embedding); the plugin rejects them before they are queued.
    (
        "input-ids-out-of-vocab",
        {"input_ids": [5, 100000, 6], "sampling_params": {"max_new_tokens": 4}},
        400,
        "out-of-vocabulary token id 100000",
    ),
    (
        "input-ids-negative",
        {"input_ids": [5, -1], "sampling_params": {"max_new_tokens": 4}},
        400,
        "out-of-vocabulary token id -1",
    ),
]


@pytest.mark.parametrize(
    "body, status, needle",
    [c[1:] for c in BAD_JSON_BODIES],
    ids=[c[0] for c in BAD_JSON_BODIES],
)
def test_bad_generate_input_gets_4xx_and_server_keeps_serving(
    server, body, status, needle
):
    r = post(server, body, timeout=60)
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert needle in r.text, r.text[:500]
    assert_serving(server)


BAD_RAW = [
    # (id, path, raw body, headers, substring)
    (
        "malformed-json",
        "/generate",
        b'{"text": "Hi", "sampling_params": {',
        {"content-type": "application/json"},
        "JSON decode error",
    ),
    (
        "nan-literal",
        "/generate",
        b'{"text": "Hi", "sampling_params": {"custom_params": {"kara": {"retention": NaN}}}}',
        {"content-type": "application/json"},
        "JSON decode error",
    ),
    (
        "empty-body",
        "/generate",
        b"",
        {"content-type": "application/json"},
        "Field required",
    ),
    (
        "text-plain",
        "/generate",
        b'{"text": "Hi", "sampling_params": {"max_new_tokens": 4}}',
        {"content-type": "text/plain"},
        "Input should be a dictionary",
    ),
    (
        "form-encoded",
        "/generate",
        b"text=Hi",
        {"content-type": "application/x-www-form-urlencoded"},
        "Input should be a dictionary",
    ),
    (
        "chat-text-plain",
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}',
        {"content-type": "text/plain"},
        "Unsupported Media Type",
    ),
    (
        "chat-malformed-json",
        "/v1/chat/completions",
        b'{"model": "m", "messages": [',
        {"content-type": "application/json"},
        "JSON decode error",
    ),
]


@pytest.mark.parametrize(
    "path, raw, headers, needle", [c[1:] for c in BAD_RAW], ids=[c[0] for c in BAD_RAW]
)
def test_malformed_bodies_get_400(server, path, raw, headers, needle):
    r = requests.post(server.url + path, data=raw, headers=headers, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert needle in r.text, r.text[:500]
    assert_serving(server)


BAD_OPENAI = [
    (
        "completions-retention",
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 4, "custom_params": {"kara": {"retention": 2}}},
        "retention must be a number in (0, 1]",
    ),
    (
        "chat-enable-string",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "custom_params": {"kara": {"enable": "no"}},
        },
        "enable must be a bool",
    ),
    (
        "completions-max-tokens-negative",
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": -5},
        "max_tokens must be positive",
    ),
    (
        "completions-max-tokens-huge",
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 10_000_000},
        "maximum context length of 2048",
    ),
    (
        "completions-prompt-beyond-context",
        "/v1/completions",
        {"prompt": "Let x = 3 and y = 4. " * 2000, "max_tokens": 4},
        "longer than the model's context length",
    ),
]


@pytest.mark.parametrize(
    "path, body, needle", [c[1:] for c in BAD_OPENAI], ids=[c[0] for c in BAD_OPENAI]
)
def test_bad_openai_input_gets_400(server, path, body, needle):
    r = post(server, {"model": "reasoning_proxy", **body}, path=path, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert needle in r.text, r.text[:500]
    assert_serving(server)


def test_after_bad_input_no_leak(server):
    assert_clean(server)


# ------------------------------------------------------------------ item 4a: disconnects and aborts
def test_disconnects_and_aborts_during_compression(server):
    """8 streams of 110 tokens (first window compressed after ~40 tokens, then every 24): 2 drop
    the connection (one before, one after its first compression), 3 are aborted through
    /abort_request once compressed (at staggered points of the 4-step event period), 3 run to
    the end."""
    n = 110
    plan = {
        "close-0": dict(close_after=5),
        "close-1": dict(close_after=57),
        "abort-0": dict(abort_after=50),
        "abort-1": dict(abort_after=57),
        "abort-2": dict(abort_after=67),
        "full-0": {},
        "full-1": {},
        "full-2": {},
    }
    tic = time.time()
    with ThreadPoolExecutor(len(plan)) as pool:
        futs = {
            rid: pool.submit(stream, server, rid, n, **kw) for rid, kw in plan.items()
        }
        results = {rid: f.result() for rid, f in futs.items()}
    closed_at = time.time()
    for rid, (chunks, last, closed) in results.items():
        meta = last["meta_info"]
        if rid.startswith("close"):
            assert closed and chunks == plan[rid]["close_after"]
        elif rid.startswith("abort"):
            assert not closed and meta["finish_reason"]["type"] == "abort", meta
            # aborted after at least one compression of its KV
            assert meta["kara"]["compressions"] >= 1, meta
            assert meta["completion_tokens"] < n
        else:
            assert (
                meta["finish_reason"]["type"] == "length"
                and meta["completion_tokens"] == n
            ), meta
            assert meta["kara"]["compressions"] >= 3, meta["kara"]
    # The dropped connections are aborted by the server (SGLang aborts 2 s after disconnect):
    # flush_cache succeeds long before they could have generated their 110 tokens.
    assert_clean(server, within=30)
    report(
        "disconnect/abort",
        streams=len(plan),
        closed=2,
        aborted=3,
        completed=3,
        aborted_at={
            rid: results[rid][1]["meta_info"]["completion_tokens"]
            for rid in plan
            if rid.startswith("abort")
        },
        aborted_compressions={
            rid: results[rid][1]["meta_info"]["kara"]["compressions"]
            for rid in plan
            if rid.startswith("abort")
        },
        seconds=round(closed_at - tic, 1),
        flush_after=round(time.time() - closed_at, 1),
    )


# ------------------------------------------------------------------ item 4b: injected compression failure
def test_injected_compression_failure_is_isolated(server):
    """3 faulty rids fail at their first compression (~45 tokens) while 5 others run on."""
    n = 80
    rids = [f"faulty-{i}" for i in range(3)] + [f"normal-{i}" for i in range(5)]
    tic = time.time()
    with ThreadPoolExecutor(len(rids)) as pool:
        futs = {
            rid: pool.submit(sampled, server, f"Let x = {rid}.", n, rid=rid)
            for rid in rids
        }
        results = {rid: f.result() for rid, f in futs.items()}
    seconds = time.time() - tic
    for rid, r in results.items():
        if rid.startswith("faulty"):
            # SGLang turns the FINISH_ABORT(status_code=500) into an HTTP 500 with its message.
            assert r.status_code == 500, (rid, r.status_code, r.text[:300])
            assert "KV compression failed" in r.text and "injected fault" in r.text, (
                r.text[:300]
            )
        else:
            assert r.status_code == 200, (rid, r.text[:300])
            meta = r.json()["meta_info"]
            assert (
                meta["completion_tokens"] == n
                and meta["finish_reason"]["type"] == "length"
            )
            assert meta["kara"]["compressions"] >= 1, meta["kara"]
    log = server.log_text()
    for rid in rids[:3]:
        assert f"Kara compression failed for request {rid}" in log
    assert_clean(server)
    report("injected fault", faulty=3, normal=5, tokens=n, seconds=round(seconds, 1))


# ------------------------------------------------------------------ item 5: bounded load
def run_load(
    server, clients: int, per_client: int, seed: int, timeout: float, max_len: int = 300
):
    """`clients` threads, each sending `per_client` /generate requests in turn: lengths
    16..max_len, every 6th with n=2, every 5th with compression disabled. Returns figures."""
    rng = random.Random(seed)
    jobs = []
    for c in range(clients):
        for k in range(per_client):
            i = c * per_client + k
            jobs.append(
                dict(
                    c=c,
                    n_tokens=rng.randint(16, max_len),
                    n=2 if i % 6 == 0 else 1,
                    custom={"kara": {"enable": False}} if i % 5 == 0 else None,
                    text=f"Client {c} request {k}: let x = {rng.randint(0, 99)}, then",
                )
            )
    by_client = [[j for j in jobs if j["c"] == c] for c in range(clients)]
    deadline = time.time() + timeout

    def client(my_jobs):
        outs = []
        for j in my_jobs:
            left = deadline - time.time()
            assert left > 0, "load test over its time bound"
            r = sampled(
                server,
                j["text"],
                j["n_tokens"],
                custom=j["custom"],
                n=j["n"],
                timeout=left,
            )
            outs.append((j, r))
        return outs

    tic = time.time()
    with ThreadPoolExecutor(clients) as pool:
        results = [o for outs in pool.map(client, by_client) for o in outs]
    seconds = time.time() - tic
    assert len(results) == len(jobs)
    sequences = tokens = compressed = 0
    for j, r in results:
        assert r.status_code == 200, (j, r.status_code, r.text[:300])
        outs = r.json()
        outs = outs if isinstance(outs, list) else [outs]
        assert len(outs) == j["n"], (j, len(outs))
        for o in outs:
            meta = o["meta_info"]
            assert (
                meta["finish_reason"]["type"] == "length"
                and meta["completion_tokens"] == j["n_tokens"]
            ), (j, meta)
            kara = meta["kara"]
            logical = meta["prompt_tokens"] + j["n_tokens"] - 1
            assert kara["kv_logical_len"] == logical, (j, kara)
            # every window compressed drops exactly W - U - K = 24 entries
            assert (
                kara["kv_physical_len"]
                == logical - DROPPED_PER_EVENT * kara["compressions"]
            ), (j, kara)
            if j["custom"] is not None:
                assert kara["enabled"] is False and kara["compressions"] == 0
            elif j["n_tokens"] >= 64:
                assert kara["compressions"] >= 1, (j, kara)
            sequences += 1
            tokens += meta["completion_tokens"]
            compressed += kara["compressions"] > 0
    assert_clean(server)
    return dict(
        clients=clients,
        requests=len(jobs),
        lengths=f"16-{max_len}",
        sequences=sequences,
        generated_tokens=tokens,
        sequences_compressed=compressed,
        seconds=round(seconds, 1),
        tokens_per_second=round(tokens / seconds, 1),
    )


def test_load_64_clients(server):
    figures = run_load(
        server, clients=64, per_client=1, seed=7, timeout=300, max_len=100
    )
    report("load 64x1", **figures)


@pytest.mark.slow
def test_load_64_clients_x3(server):
    figures = run_load(
        server, clients=64, per_client=3, seed=8, timeout=1800, max_len=300
    )
    report("load 64x3", **figures)


# ------------------------------------------------------------------ item 4c: kill -9 and restart
def live_group_members(pgid: int) -> list[str]:
    """Non-zombie processes of a process group (orphaned zombies may wait for a reaper)."""
    ps = subprocess.run(
        ["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True, check=True
    ).stdout
    return [
        line
        for line in ps.splitlines()
        if line.split()[1] == str(pgid) and not line.split()[2].startswith("Z")
    ]


@pytest.mark.slow  # a second server start: ~1-2 min on this machine
def test_kill9_and_restart_on_same_port(server):
    """SIGKILL the whole process group (HTTP server, tokenizer, scheduler, detokenizer) mid-
    request, then a new server on the same port serves; the shared fixture continues with it."""
    port, pgid = server.port, server.proc.pid
    victim = ThreadPoolExecutor(1).submit(
        sampled, server, "Killed mid-answer", 300, timeout=60
    )
    time.sleep(2)
    os.killpg(pgid, signal.SIGKILL)
    server.proc.wait(30)
    with pytest.raises(requests.RequestException):
        victim.result(timeout=60).raise_for_status()
    deadline = time.time() + 30
    while live_group_members(pgid):
        assert time.time() < deadline, (
            f"killed group still has live processes: {live_group_members(pgid)}"
        )
        time.sleep(0.5)
    with pytest.raises(requests.ConnectionError):
        requests.get(server.url + "/health", timeout=5)
    server.log.close()
    tic = time.time()
    new = Server(SERVER_ARGS, env=SERVER_ENV, port=port, log_tag="_restart")
    restart = time.time() - tic
    server.__dict__.update(new.__dict__)  # fixture teardown stops the new one
    r = sampled(server, "Let x = 3. Then", 80)
    assert (
        r.status_code == 200 and r.json()["meta_info"]["kara"]["compressions"] >= 1
    ), r.text[:300]
    assert_clean(server)
    report("kill -9 restart", port=port, restart_seconds=round(restart, 1))


# ------------------------------------------------------------------ item 2: retraction storm
RETRACT_PROMPTS = [
    f"{p} {i}"
    for i in range(3)
    for p in (
        "Hello world",
        "The answer is",
        "Let x = 3. Let y = x + 4, so y = 7. Then z",
        "Once upon a time there was a server",
    )
]
KARA_SMALL = dict(
    kara_window=40, kara_buffer=8, kara_chunk_budget=4, kara_max_chunk=6, kara_period=4
)


def run_retraction_storm(
    model_path, n_requests: int, gen: int, interval: int, max_total_tokens: int
):
    with engine_env(
        SGLANG_TEST_RETRACT="1",
        SGLANG_TEST_RETRACT_INTERVAL=str(interval),
        KARA_CHECK_INTEGRITY="1",
    ):
        engine = start_engine(
            "kara",
            model_path,
            kara_retention=0.25,
            kara_query_source="capture",
            max_total_tokens=max_total_tokens,
            max_running_requests=n_requests,
            **KARA_SMALL,
        )
    try:
        tic = time.time()
        # min_new_tokens = max_new_tokens: EOS cannot end an answer early.
        outs = engine.generate(
            RETRACT_PROMPTS[:n_requests],
            {"max_new_tokens": gen, "min_new_tokens": gen, "temperature": 0.7},
        )
        seconds = time.time() - tic
        assert flush_when_idle(engine)  # strict idle check: no slot leaked
        again = engine.generate("Hello", {"max_new_tokens": 2, "ignore_eos": True})
        assert again["meta_info"]["completion_tokens"] == 2
    finally:
        engine.shutdown()
    retractions = [o["meta_info"].get("num_retractions", 0) for o in outs]
    for o in outs:
        meta, kara = o["meta_info"], o["meta_info"]["kara"]
        assert (
            meta["completion_tokens"] == gen
            and meta["finish_reason"]["type"] == "length"
        ), meta
        logical = meta["prompt_tokens"] + gen - 1
        assert kara["kv_logical_len"] == logical, kara
        # counts restart at each re-prefill; each window since drops exactly 24 entries
        assert (
            kara["kv_physical_len"]
            == logical - DROPPED_PER_EVENT * kara["compressions"]
        ), kara
        assert kara["integrity_checks"] >= kara["compressions"]
    assert sum(retractions) >= len(outs), retractions
    # compressed again after a re-prefill (counts restart at a retraction)
    recompressed = sum(
        1
        for o, n in zip(outs, retractions)
        if n > 0 and o["meta_info"]["kara"]["compressions"] > 0
    )
    assert recompressed >= 1, [
        (n, o["meta_info"]["kara"]) for o, n in zip(outs, retractions)
    ]
    return dict(
        retractions_per_request=retractions,
        retracted_then_compressed=recompressed,
        requests=len(outs),
        tokens_each=gen,
        pool=max_total_tokens,
        interval=interval,
        retractions=sum(retractions),
        max_retractions_one_request=max(retractions),
        final_compressions=sum(o["meta_info"]["kara"]["compressions"] for o in outs),
        seconds=round(seconds, 1),
    )


@pytest.mark.patched
def test_retraction_storm(tiny_llama):
    figures = run_retraction_storm(
        tiny_llama, n_requests=8, gen=120, interval=3, max_total_tokens=500
    )
    report("retraction storm", **figures)


@pytest.mark.slow
def test_retraction_storm_long(tiny_llama):
    figures = run_retraction_storm(
        tiny_llama, n_requests=12, gen=400, interval=2, max_total_tokens=900
    )
    report("retraction storm long", **figures)
