"""``--tp-size 2`` on this CPU, a server and engines (docs/TENSOR_PARALLEL.md).

Every TP run here has the lockstep check on (``KARA_CHECK_TP_PLAN=1``: the ranks compare a
digest of their plans and state before every event and at every decode step's end) and the
integrity checks at every event; no TP start-up variable is set (the CPU kit splits the cores
and drops PyNccl by itself).

Integration tier, one TP 2 server for the module (``python -m sgl_kara.launch_server --tp-size
2``, Kara with captured queries at page 1): the TP oracle -- the same requests through it and
through the session's TP 1 engine of that configuration give the same tokens, compressions,
physical and logical KV lengths and, per layer and KV head, the same evicted positions (each
rank records its own heads; their union is compared with TP 1's). Scores differ between the two
only by float summation order (TP 2 all-reduces partial sums; 6.6e-7 relative at most in the
runs behind docs/TENSOR_PARALLEL.md), so the kept sets are compared exactly: a selection at a
near-tie within that difference would show here as a mismatch naming the head. TP 2 is also
checked step by step against the Hugging Face reference with exactly its evictions masked
(tests/oracle.py), an independent reference. Then an abort with nothing lost, and last a
divergence injected on rank 1, which stops the server with a message naming rank 1 instead of
hanging.

Slow tier: TP 2 engines against TP 1 engines (recomputed queries at page 16, every other
policy), retention 1.0 against plain SGLang at TP 2, shared system prompts / ``n > 1`` samples /
per-request options; a server under SGLang's forced retractions (every 3 forward passes) for a
request alone against the reference, a retraction storm with aborts, and a fault on rank 1 only
that fails its request on both ranks while the server keeps serving.

Integration tier too, a TP 2 server as production runs it (overlap on, no plan digest, no
integrity checks, recomputed queries at page 16): a fault injected on rank 1 inside the recompute
forward ends that request with an error naming rank 1 within a bounded time, the other request
completes compressed, the pool is whole and the server keeps serving.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from oracle import (
    GEN,
    _check_against_reference,
    _prompts,
    engine_options,
    shared_engine,
)
from oracle import read_evictions as read_events
from support import (
    Server,
    engine_env,
    flush_when_idle,
    generate,
    start_engine,
)

pytestmark = pytest.mark.integration

CHECKS = {"KARA_CHECK_TP_PLAN": "1", "KARA_CHECK_INTEGRITY": "1"}
PROMPTS = [
    "Hello world",
    "The answer is",
    "Let x = 3. Let y = x + 4, so y = 7. Then z",
    "Once upon a time there was a server",
]
FULL = {"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}
SYSTEM = (
    "You are a careful assistant. Reasoning models write long chains of thought, and each "
    "step looks back at values computed earlier. Answer: "
)
CONFIGS = {"capture-page1": ("capture", 1), "recompute-page16": ("recompute", 16)}


def _flags(options: dict) -> list[str]:
    """``kara_*`` / engine options as launch_server flags."""
    out = []
    for name, value in options.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


# ------------------------------------------------------------------ the module's TP 2 server
@pytest.fixture(scope="module")
def tp1_oracle(engines, tiny_llama):
    """The oracle requests through the session's TP 1 engine of the server's configuration
    (tests/oracle.py ``shared_engine``), run before the server starts."""
    from transformers import AutoConfig

    prompts = _prompts(AutoConfig.from_pretrained(tiny_llama).vocab_size)
    rids = [f"tp-oracle-{i}" for i in range(len(prompts))]
    engine, record = shared_engine(engines, tiny_llama, 1, "capture")
    outs = engine.generate(
        input_ids=prompts,
        sampling_params=GEN,
        return_logprob=True,
        top_logprobs_num=5,
        rid=rids,
    )
    events = read_events(record)
    return {
        "prompts": prompts,
        "rids": rids,
        "oracle": outs,
        "events": {rid: events[rid] for rid in rids},
    }


@pytest.fixture(scope="module")
def server_args(tiny_llama, tmp_path_factory, tp1_oracle):
    """The session's TP 1 engines' settings (tests/conftest.py ENGINE_COMMON), Kara at r 0.25
    with captured queries at page 1 (tests/oracle.py KARA), at TP 2; a divergence armed on rank 1
    for requests named ``diverge`` (the module's last test)."""
    record = str(tmp_path_factory.mktemp("tp_server") / "evictions.jsonl")
    return {
        "args": [
            "--model-path",
            tiny_llama,
            "--tp-size",
            "2",
            *_flags(engine_options("kara", "capture", 1)),
            "--max-total-tokens",
            "16384",
            "--max-running-requests",
            "16",
            "--random-seed",
            "0",
            "--sleep-on-idle",
        ],
        "env": {
            **CHECKS,
            "KARA_RECORD_EVICTIONS": record,
            "KARA_INJECT_TP_DIVERGENCE": "1:diverge",
        },
        "timeout": 300,
        "record": record,
    }


@pytest.fixture(scope="module")
def tp_oracle(server, server_args, tp1_oracle):
    """The oracle requests through the TP 2 server (at once, as one batch would) and through
    the TP 1 engine: {2: ..., 1: ...}, each with its outputs and its recorded evictions."""
    prompts, rids = tp1_oracle["prompts"], tp1_oracle["rids"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(
            pool.map(
                lambda a: generate(
                    server, a[0], GEN, rid=a[1], return_logprob=True, top_logprobs_num=5
                ),
                zip(prompts, rids),
            )
        )
    for r in responses:
        assert r.status_code == 200, r.text
    events = read_events(server_args["record"])
    return {
        "prompts": prompts,
        2: {
            "oracle": [r.json() for r in responses],
            "events": {rid: events[rid] for rid in rids},
        },
        1: tp1_oracle,
    }


def compare_ranks(tp2: dict, tp1: dict) -> tuple[int, int, int]:
    """TP 2 against TP 1 on the oracle requests: the same tokens, compressions, lengths and, per
    layer and KV head, evicted positions. Returns (requests, events, (layer, head) sets)."""
    same_tokens = events = heads = 0
    for a, b in zip(tp2["oracle"], tp1["oracle"]):
        rid = a["meta_info"]["id"]
        assert rid == b["meta_info"]["id"]
        assert a["output_ids"] == b["output_ids"], (
            f"{rid}: TP 2 and TP 1 tokens differ from step "
            f"{next(i for i, (x, y) in enumerate(zip(a['output_ids'], b['output_ids'])) if x != y)}"
        )
        same_tokens += 1
        ka, kb = a["meta_info"]["kara"], b["meta_info"]["kara"]
        for field in ("compressions", "kv_physical_len", "kv_logical_len"):
            assert ka[field] == kb[field], (rid, field, ka, kb)
        ea, eb = tp2["events"][rid], tp1["events"][rid]
        assert len(ea) == len(eb) >= 3, (rid, len(ea), len(eb))
        for x, y in zip(ea, eb):
            assert x["logical_len"] == y["logical_len"]
            assert len(x["evicted"]) == len(y["evicted"])
            for layer, (hx, hy) in enumerate(zip(x["evicted"], y["evicted"])):
                assert (
                    len(hx) == len(hy) == 2
                )  # the tiny Llama's two KV heads, one per rank
                for h, (px, py) in enumerate(zip(hx, hy)):
                    assert px == py, (rid, x["event"], layer, h)
                    heads += 1
            events += 1
    return same_tokens, events, heads


def test_tp2_and_tp1_compress_alike(tp_oracle, server):
    """Same tokens, compressions, lengths and per-head evicted positions, every rank's plan
    digest compared at every step."""
    same_tokens, events, heads = compare_ranks(tp_oracle[2], tp_oracle[1])
    stats = _kara_stats(server)
    assert stats["failed_requests"] == 0 and stats["events"] >= 3, stats
    # a digest gathered at every decode step's end and before every event
    assert stats["tp_plan_checks"] > stats["decode_steps"] > 0, stats
    print(
        f"\nTP ORACLE capture-page1: tokens identical {same_tokens}/{len(tp_oracle[2]['oracle'])}"
        f", {events} events, {heads} (layer, head) kept sets identical; "
        f"{stats['tp_plan_checks']} plan digests agreed over {stats['decode_steps']} steps"
    )


def test_tp2_matches_the_masked_reference(tp_oracle, tiny_llama):
    """Each decode step at TP 2 equals the Hugging Face model with exactly the entries the two
    ranks evicted masked (their records merged), and the unmasked reference is far off."""
    _check_against_reference(
        tiny_llama,
        tp_oracle["prompts"],
        tp_oracle[2]["oracle"],
        tp_oracle[2]["events"],
        "kara",
        1,
        "capture",
    )


def test_an_abort_at_tp2_loses_nothing(tp_oracle, server):
    """A request aborted once compressed: it ends as aborted and every slot comes back, on rank
    0's pool here and under the strict idle checks in both ranks' schedulers."""
    from test_reliability import stream

    _, last, _ = stream(server, "abort-0", 100, abort_after=60)
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    _pool_whole(server)


def test_a_divergence_on_one_rank_stops_the_server_naming_it(server):
    """Last on the module's server: rank 1 drops the request's job from its event plan."""
    try:
        r = generate(server, "Let x = 3. Then", {"max_new_tokens": 80}, rid="diverge-0")
        status = r.status_code
    except requests.RequestException:
        status = None  # the server went down under the request
    assert status != 200
    deadline = time.time() + 120
    while server.proc.poll() is None and time.time() < deadline:
        time.sleep(1)
    assert server.proc.poll() is not None, "the server still runs after a divergence"
    log = server.log_text()
    assert "PlanDivergence: Kara's tensor-parallel ranks diverged at decode step" in log
    assert "TP rank 1's plan differs from TP rank 0's" in log
    assert "KARA_INJECT_TP_DIVERGENCE: TP rank 1 drops request diverge-0" in log


# ------------------------------------------------------------------ slow: engines, TP 2 vs TP 1
def _oracle_requests(engine, vocab: int) -> dict:
    """The oracle's requests (log-probabilities recorded): what every engine of a pair serves."""
    prompts = _prompts(vocab)
    return {
        "prompts": prompts,
        "oracle": engine.generate(
            input_ids=prompts,
            sampling_params=GEN,
            return_logprob=True,
            top_logprobs_num=5,
            rid=[f"oracle-{i}" for i in range(len(prompts))],
        ),
    }


def _stats_when_idle(engine, out: dict) -> dict:
    assert flush_when_idle(engine), "slots still held after every request finished"
    out["stats"] = engine.get_server_info()["internal_states"][0]["kara"]
    return out


def _run_requests(engine, vocab: int) -> dict:
    """The oracle's requests, then retention 1.0, shared prompts, samples and per-request options,
    and what the engine reports after them."""
    out = _oracle_requests(engine, vocab)
    full = dict(FULL, custom_params={"kara": {"retention": 1.0}})
    out["full"] = engine.generate(PROMPTS, full)
    # a shared system prompt: parallel samples first, then three requests that find it cached,
    # with per-request options
    greedy = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    out["samples"] = engine.generate(
        SYSTEM + "what is 12 plus 30?",
        {"max_new_tokens": 120, "temperature": 0.8, "ignore_eos": True, "n": 2},
    )
    out["options"] = engine.generate(
        [SYSTEM + q for q in ("x = 3, y = 7.", "the capital?", "the key value cache")],
        [
            {**greedy, "custom_params": {"kara": {"retention": 0.5}}},
            {**greedy, "custom_params": {"kara": {"enable": False}}},
            greedy,
        ],
    )
    return _stats_when_idle(engine, out)


def run_pair(model: str, options: dict, tmp, run=_run_requests) -> dict:
    """The same requests (``run(engine, vocab)``) through sgl_kara at TP 2 and TP 1, one engine
    at a time, evictions recorded: {2: ..., 1: ...}, each with its merged ``events`` and
    ``seconds`` (start, requests)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    runs = {}
    for tp in (2, 1):
        record = str(tmp / f"evictions_tp{tp}.jsonl")
        with engine_env(KARA_RECORD_EVICTIONS=record, **CHECKS):
            tic = time.time()
            engine = start_engine("kara", model, tp_size=tp, **options)
            started = time.time() - tic
        try:
            runs[tp] = run(engine, vocab)
        finally:
            engine.shutdown()
        runs[tp]["events"] = read_events(record)
        runs[tp]["seconds"] = (started, time.time() - tic - started)
    return runs


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine_pair(request, tiny_llama, tmp_path_factory):
    query_source, page = CONFIGS[request.param]
    runs = run_pair(
        tiny_llama,
        engine_options("kara", query_source, page),
        tmp_path_factory.mktemp(f"tp_{request.param}"),
    )
    return {**runs, "config": (query_source, page)}


@pytest.fixture(scope="module")
def plain_sglang_tp2(tiny_llama):
    """Plain ``sglang.Engine(tp_size=2)`` (sgl_kara installed: its CPU start-up fixes only)."""
    engine = start_engine("sglang", tiny_llama, tp_size=2)
    try:
        return [o["text"] for o in engine.generate(PROMPTS, FULL)]
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_tp2_and_tp1_engines_compress_alike(engine_pair):
    """Engines at both query sources and pages: the oracle's comparison, and the other
    requests' outputs and Kara's counters alike."""
    tp2, tp1 = engine_pair[2], engine_pair[1]
    same_tokens, events, heads = compare_ranks(tp2, tp1)
    for a, b in zip(tp2["full"] + tp2["options"], tp1["full"] + tp1["options"]):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["kara"] == b["meta_info"]["kara"]
    for name in ("events", "requests_compressed", "tokens_dropped", "failed_requests"):
        assert tp2["stats"][name] == tp1["stats"][name], name
    assert tp2["stats"]["failed_requests"] == 0
    print(
        f"\nTP ORACLE {engine_pair['config']}: tokens identical {same_tokens}/"
        f"{len(tp2['oracle'])} oracle requests (+{len(tp2['full']) + len(tp2['options'])} "
        f"others), {events} events, {heads} (layer, head) kept sets identical; "
        f"seconds (start, requests) TP 2 {tp2['seconds'][0]:.0f}, {tp2['seconds'][1]:.0f}; "
        f"TP 1 {tp1['seconds'][0]:.0f}, {tp1['seconds'][1]:.0f}"
    )


@pytest.mark.slow
def test_tp2_engine_matches_the_masked_reference(engine_pair, tiny_llama):
    query_source, page = engine_pair["config"]
    tp2 = engine_pair[2]
    _check_against_reference(
        tiny_llama,
        tp2["prompts"],
        tp2["oracle"],
        tp2["events"],
        "kara",
        page,
        query_source,
    )


@pytest.mark.slow
def test_full_retention_at_tp2_is_plain_sglang_at_tp2(engine_pair, plain_sglang_tp2):
    for out, ref in zip(engine_pair[2]["full"], plain_sglang_tp2):
        kara = out["meta_info"]["kara"]
        assert kara["compressions"] >= 3, kara
        assert kara["kv_physical_len"] == kara["kv_logical_len"]
        assert out["text"] == ref


@pytest.mark.slow
def test_shared_prompts_samples_and_options_at_tp2(engine_pair):
    tp2 = engine_pair[2]
    for out in tp2["samples"]:
        kara = out["meta_info"]["kara"]
        assert out["meta_info"]["completion_tokens"] == 120
        assert kara["compressions"] >= 2 and kara["integrity_checks"] >= 1, kara
    half, off, default = tp2["options"]
    for out in (half, off, default):
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 120
        assert meta["cached_tokens"] >= len(SYSTEM) // 8, (
            meta
        )  # the system prompt, cached
    assert off["meta_info"]["kara"]["compressions"] == 0
    assert not off["meta_info"]["kara"]["enabled"]
    assert half["meta_info"]["kara"]["compressions"] >= 1
    assert default["meta_info"]["kara"]["compressions"] >= 1
    assert (
        half["meta_info"]["kara"]["kv_physical_len"]
        > default["meta_info"]["kara"]["kv_physical_len"]
    )


# ------------------------------------------------------------------ slow: every other policy
def _oracle_requests_and_stats(engine, vocab: int) -> dict:
    return _stats_when_idle(engine, _oracle_requests(engine, vocab))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "rkv", "streaming", "random"])
def test_every_policy_at_tp2(policy, tiny_llama, tmp_path):
    """Every policy but Kara: TP 2 against TP 1 and against the masked reference, captured
    queries, page 1, their small options."""
    from oracle import small_options

    runs = run_pair(
        tiny_llama,
        engine_options(policy, "capture", 1, small_options(policy)),
        tmp_path,
        run=_oracle_requests_and_stats,
    )
    same_tokens, events, heads = compare_ranks(runs[2], runs[1])
    assert runs[2]["stats"]["events"] >= 3
    _check_against_reference(
        tiny_llama,
        runs[2]["prompts"],
        runs[2]["oracle"],
        runs[2]["events"],
        policy,
        1,
        "capture",
    )
    print(
        f"\nTP ORACLE {policy}: tokens identical {same_tokens}/3, {events} events, "
        f"{heads} (layer, head) kept sets identical"
    )


# ------------------------------------------------------------------ slow: a server under retractions
KARA_ARGS = [  # tests/oracle.py KARA at r 0.25, recomputed queries, page 16
    "--kara-window",
    "40",
    "--kara-buffer",
    "8",
    "--kara-max-chunk",
    "6",
    "--kara-period",
    "4",
    "--kara-retention",
    "0.25",
    "--kara-query-source",
    "recompute",
    "--page-size",
    "16",
]


@pytest.fixture(scope="module")
def storm_server(tiny_llama, tmp_path_factory):
    """Kara with recomputed queries at page 16 under SGLang's forced retractions (every 3 forward
    passes), a fault armed on rank 1 for requests named ``faulty``."""
    record = str(tmp_path_factory.mktemp("tp_storm") / "evictions.jsonl")
    srv = Server(
        [
            "--model-path",
            tiny_llama,
            "--tp-size",
            "2",
            *KARA_ARGS,
            "--max-total-tokens",
            "4096",
            "--max-running-requests",
            "8",
            "--random-seed",
            "0",
        ],
        timeout=600,
        env={
            **CHECKS,
            "KARA_RECORD_EVICTIONS": record,
            "SGLANG_TEST_RETRACT": "1",
            "SGLANG_TEST_RETRACT_INTERVAL": "3",
            "KARA_INJECT_FAULT_RID_PREFIX": "faulty",
            "KARA_INJECT_FAULT_AT": "commit",
            "KARA_INJECT_FAULT_TP_RANK": "1",
        },
    )
    srv.record = record
    yield srv
    srv.stop()


def _kara_stats(server) -> dict:
    info = requests.get(server.url + "/server_info", timeout=30).json()
    return info["internal_states"][0]["kara"]


def _pool_whole(server, within: float = 60.0) -> dict:
    """Flush (refused while anything runs), then every slot free on rank 0's pool; the strict
    idle checks run inside both ranks' schedulers."""
    deadline = time.time() + within
    while requests.post(server.url + "/flush_cache", timeout=30).status_code != 200:
        assert time.time() < deadline, "flush_cache still refused"
        time.sleep(0.5)
    stats = _kara_stats(server)
    assert stats["free_slots"] == stats["pool_slots"], stats
    assert server.proc.poll() is None
    return stats


@pytest.mark.slow
def test_launch_server_tp2_is_exact_for_a_request_alone(storm_server, tiny_llama):
    from transformers import AutoConfig

    (prompt,) = _prompts(AutoConfig.from_pretrained(tiny_llama).vocab_size, 1)
    r = generate(
        storm_server,
        prompt,
        GEN,
        rid="alone-0",
        return_logprob=True,
        top_logprobs_num=5,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["kara"]["compressions"] >= 3
    events = read_events(storm_server.record)
    _check_against_reference(
        tiny_llama,
        [prompt],
        [out],
        {"alone-0": events["alone-0"]},
        "kara",
        16,
        "recompute",
    )


def _sampled(server, rid: str, n: int, **body) -> dict:
    r = generate(
        server,
        f"Let x = {rid}. Then",
        {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0.7},
        rid=rid,
        **body,
    )
    return {
        "status": r.status_code,
        **(r.json() if r.status_code == 200 else {"text": r.text}),
    }


@pytest.mark.slow
def test_retraction_storm_and_aborts_at_tp2_lose_nothing(storm_server):
    from test_reliability import stream

    n = 100
    with ThreadPoolExecutor(8) as pool:
        storm = [pool.submit(_sampled, storm_server, f"storm-{i}", n) for i in range(6)]
        aborted = [
            pool.submit(stream, storm_server, f"abort-{i}", n, abort_after=40 + 7 * i)
            for i in range(2)
        ]
        outs = [f.result() for f in storm]
        cut = [f.result() for f in aborted]
    retractions = 0
    for out in outs:
        meta = out["meta_info"]
        assert out["status"] == 200 and meta["completion_tokens"] == n, meta
        kara = meta["kara"]
        assert kara["kv_logical_len"] == meta["prompt_tokens"] + n - 1, kara
        assert kara["integrity_checks"] >= kara["compressions"]
        retractions += meta.get("num_retractions", 0) or 0
    assert retractions >= len(outs), retractions
    for _, last, _ in cut:
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
    stats = _pool_whole(storm_server)
    print(
        f"\nTP RETRACTION STORM: {len(outs)} requests x {n} tokens, {retractions} "
        f"retractions, 2 aborted; Kara {stats['events']} events, pool whole"
    )


@pytest.mark.slow
def test_a_fault_on_one_rank_fails_the_request_on_both(storm_server):
    with ThreadPoolExecutor(3) as pool:
        futs = [
            pool.submit(_sampled, storm_server, rid, 80) for rid in ("faulty-0", "ok-0")
        ]
        faulty, ok = [f.result() for f in futs]
    # rank 0 (which answers) agreed to undo its commit: rank 1's fault, named
    assert faulty["status"] == 500, faulty
    assert "KV compression failed: failed on tensor-parallel rank 1" in faulty["text"]
    assert ok["status"] == 200 and ok["meta_info"]["completion_tokens"] == 80
    stats = _pool_whole(storm_server)
    assert stats["failed_requests"] >= 1
    log = storm_server.log_text()
    assert "Kara compression failed for request faulty-0" in log
    assert "injected fault at commit" in log  # on rank 1
    assert "PlanDivergence" not in log  # the ranks agreed: no divergence followed


# ------------------------------------------------------------------ as production runs: no checks
@pytest.fixture(scope="module")
def production_tp2(tiny_llama):
    """TP 2 as a user runs it: SGLang's overlap scheduler on, no plan digest, no integrity
    checks; recomputed queries at page 16, a fault armed inside the recompute forward on rank 1
    for requests named ``faulty``."""
    srv = Server(
        [
            "--model-path",
            tiny_llama,
            "--tp-size",
            "2",
            *KARA_ARGS,
            "--max-total-tokens",
            "4096",
            "--max-running-requests",
            "8",
            "--random-seed",
            "0",
        ],
        timeout=600,
        env={
            "KARA_INJECT_FAULT_RID_PREFIX": "faulty",
            "KARA_INJECT_FAULT_AT": "recompute",
            "KARA_INJECT_FAULT_TP_RANK": "1",
        },
    )
    yield srv
    srv.stop()


def test_a_fault_inside_the_recompute_forward_on_one_rank_names_it(production_tp2):
    """A failure on rank 1 inside the recompute forward's collectives: rank 1 runs the forward to
    the layer every rank stops at, the ranks agree on the failure, and the request ends with an
    error naming rank 1 within a bounded time -- no rank waits in a collective the other left.
    The other request, compressed alongside, completes; the pool is whole after; nothing here
    ran the plan digest or an integrity check (the overlapped path as production runs it)."""
    tic = time.time()
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(_sampled, production_tp2, rid, 120)
            for rid in ("faulty-0", "ok-0")
        ]
        faulty, ok = [f.result(timeout=180) for f in futs]
    assert time.time() - tic < 180
    assert faulty["status"] == 500, faulty
    assert "KV compression failed: failed on tensor-parallel rank 1" in faulty["text"]
    assert ok["status"] == 200, ok
    assert ok["meta_info"]["completion_tokens"] == 120
    assert ok["meta_info"]["kara"]["compressions"] >= 2, ok["meta_info"]["kara"]
    assert "integrity_checks" not in ok["meta_info"]["kara"]  # no checks ran
    stats = _pool_whole(production_tp2)
    assert stats["failed_requests"] >= 1 and stats["tp_plan_checks"] == 0, stats
    log = production_tp2.log_text()
    assert "injected fault at recompute on tensor-parallel rank 1" in log
    assert _sampled(production_tp2, "after-0", 40)["status"] == 200  # still serving
