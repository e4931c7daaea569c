"""Kara inside SGLang's runtime, on tiny CPU fixtures with strict memory checks.

(Retention 1.0 reproducing plain SGLang's greedy tokens, for Llama and Qwen3, both query sources
and both page sizes, runs in tests/test_oracle.py, on the same shared engines as the oracle.)

- at retention 0.25 every response's physical KV matches the predicted footprint, protected
  prefixes stay intact (integrity check at every event), capture and recompute scores agree on
  the first window, and n>1 samples keep sharing their prompt.
"""

import pytest
from oracle import KARA, TEXT_GEN, TEXT_GREEDY, TEXT_PROMPTS, shared_engine
from support import engine_env, flush_when_idle, start_engine

PROMPTS, GEN, GREEDY = TEXT_PROMPTS, TEXT_GEN, TEXT_GREEDY
# Small windows so a 300-token answer goes through many events: W=40, U=8 -> 32 compressible, r = 0.25
# -> K = 8, chunk budget 4 (its default at K = 8). The engines are the session's shared ones of
# this configuration (tests/oracle.py shared_engine: integrity checks, capture-vs-recompute
# cross-check with capture, evictions recorded), the ones tests/test_oracle.py runs on.
KARA_SMALL = dict(KARA, kara_retention=0.25)


def kara_engine(engines, model_path: str, query_source: str, extra: dict | None = None):
    """The session's shared Kara engine of this configuration at page size 1."""
    return shared_engine(engines, model_path, 1, query_source, extra=extra)[0]


@pytest.fixture
def compressing_engine(tiny_llama, engines):
    """The shared Kara engine on the tiny Llama with captured queries (integrity checks and the
    capture-vs-recompute cross-check on)."""
    return kara_engine(engines, tiny_llama, "capture")


def predicted_physical(prompt_tokens: int, completion: int, compressions: int) -> int:
    m = 40 - 8
    k = 8  # ceil(0.25 * 32)
    return prompt_tokens + completion - 1 - compressions * (m - k)


def test_footprint_matches_prediction(compressing_engine):
    outs = compressing_engine.generate(PROMPTS, GREEDY)
    for out in outs:
        meta, kara = out["meta_info"], out["meta_info"]["kara"]
        assert meta["completion_tokens"] == GEN
        logical = meta["prompt_tokens"] + GEN - 1
        assert kara["kv_logical_len"] == logical
        # Windows are compressed whenever W uncompressed rows exist at an event (every 4 steps),
        # so the count is fixed by the schedule: floor((tail) / 32) up to one period of lag.
        assert kara["compressions"] >= (GEN - 40 - 4) // 32
        assert kara["kv_physical_len"] == predicted_physical(
            meta["prompt_tokens"], GEN, kara["compressions"]
        )
        assert kara["kv_physical_len"] < 0.5 * logical
        assert kara["integrity_checks"] >= kara["compressions"]


def test_query_sources_agree_on_first_window(compressing_engine):
    outs = compressing_engine.generate(PROMPTS, GREEDY)
    for out in outs:
        err = out["meta_info"]["kara"]["query_crosscheck_max_rel_err"]
        # fp16 KV pool on CPU: the capture path sees decode-time queries, the recompute path an
        # extend over the same cached KV; they agree to fp16 rounding.
        assert err < 2e-2, err


@pytest.mark.patched
def test_parallel_samples_share_prompt_and_cache_hit(compressing_engine):
    prompt = "Let x = 3. Let y = x + 4, so y = 7. Then z = y - 2 = 5. The answer"
    params = {"max_new_tokens": 200, "temperature": 0.8, "ignore_eos": True, "n": 4}
    outs = compressing_engine.generate(prompt, params)
    assert len(outs) == 4
    for out in outs:
        kara = out["meta_info"]["kara"]
        assert out["meta_info"]["completion_tokens"] == 200
        assert kara["compressions"] >= 3
        assert (
            kara["integrity_checks"] >= kara["compressions"]
        )  # prompt slots and bytes unchanged
    again = compressing_engine.generate(
        prompt, {"max_new_tokens": 4, "temperature": 0.0}
    )
    assert (
        again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 1
    )


def test_flush_leaves_every_slot_free(compressing_engine):
    compressing_engine.generate(PROMPTS, GREEDY)
    assert flush_when_idle(compressing_engine)
    # The strict idle check (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1) raises inside the
    # scheduler on any leaked slot; a further request proves the scheduler is alive.
    out = compressing_engine.generate(
        "Hello", {"max_new_tokens": 2, "temperature": 0.0}
    )
    assert out["meta_info"]["completion_tokens"] == 2


@pytest.mark.integration  # a retraction scenario on an engine of its own (docs/TESTING.md, tiers)
@pytest.mark.patched
def test_tight_pool_retracts_and_completes(tiny_llama):
    """Over-admission under pressure: natural retraction, then every request still completes.

    Kara's admission charges each new request its compressed footprint (~120 tokens here), so a
    single burst of requests never over-commits the 900-token pool. Running requests, though,
    are charged only SGLang's new-token ratio of their future, set near zero here. So a first
    wave of 6 is admitted, and once it decodes, a second wave of 6 is admitted too; 12 x ~115
    compressed tokens > 900, so the pool must run out mid-decode and SGLang must retract.

    That holds only if the second wave is admitted while the first is young: a tiny model decodes
    300 steps in a few seconds, so on a loaded machine the second wave can arrive late, be admitted
    a few at a time and fit. Each attempt therefore records the first wave's progress when each
    second-wave request starts; an attempt where all six started before the first wave passed
    GEN/2 tokens must retract (at GEN the first wave holds 6 x ~110 and the second >= 6 x ~72
    tokens), and up to three attempts are made to get one.
    """
    import asyncio

    with engine_env(SGLANG_INIT_NEW_TOKEN_RATIO="0.01"):
        engine = start_engine(
            "kara",
            tiny_llama,
            kara_query_source="capture",
            max_total_tokens=900,
            max_running_requests=12,
            **KARA_SMALL,
        )
    params = {"max_new_tokens": GEN, "min_new_tokens": GEN, "temperature": 0.0}

    retracted_at = {}  # request -> tokens it had when its stream first showed a retraction

    async def run_one(prompt, started, progress, key):
        last, seen = None, 0
        async for chunk in await engine.async_generate(prompt, params, stream=True):
            started.set()
            meta = chunk["meta_info"]
            if meta.get("num_retractions", 0) > seen:  # first chunk after a retraction
                seen = meta["num_retractions"]
                retracted_at[key] = progress.get(key, 0)
            progress[key] = meta["completion_tokens"]
            last = chunk
        last["meta_info"]["retracted_at"] = retracted_at.get(key)
        return last

    async def run_all(attempt):
        retracted_at.clear()
        waves = [
            [f"{p} {i} {attempt}" for i in range(w, w + 2) for p in PROMPTS[:3]]
            for w in (0, 2)
        ]
        progress, first_seen_at = {}, []
        first_started = [asyncio.Event() for _ in waves[0]]
        first = [
            asyncio.create_task(run_one(p, e, progress, i))
            for i, (p, e) in enumerate(zip(waves[0], first_started))
        ]
        await asyncio.gather(*(e.wait() for e in first_started))

        async def second_one(p, j):
            started = asyncio.Event()
            task = asyncio.create_task(run_one(p, started, progress, ("second", j)))
            await started.wait()
            first_seen_at.append(
                max(v for k, v in progress.items() if isinstance(k, int))
            )
            return await task

        second = [asyncio.create_task(second_one(p, j)) for j, p in enumerate(waves[1])]
        outs = await asyncio.gather(*first, *second)
        return outs, max(first_seen_at)

    try:
        for attempt in range(3):
            outs, first_wave_progress = engine.loop.run_until_complete(run_all(attempt))
            assert len(outs) == 12
            assert all(o["meta_info"]["completion_tokens"] == GEN for o in outs)
            if first_wave_progress <= GEN // 2:
                break
        else:
            pytest.fail(
                f"the second wave never started before the first passed {GEN // 2} tokens "
                f"(last: {first_wave_progress}): machine too loaded for this scenario"
            )
    finally:
        engine.shutdown()
    retracted = [
        o["meta_info"] for o in outs if o["meta_info"].get("num_retractions", 0)
    ]
    assert retracted
    # A re-prefilled request inserts only its prompt into the tree, so its regenerated history
    # is compressed again (catch-up passes) instead of becoming a protected prefix -- if it has
    # steps left for them: one retracted 3 tokens before its end finishes uncompressed (events
    # skip requests about to finish; seen once events began fitting partial groups to the pool,
    # which makes the pool last longer and retractions come later).
    room = KARA_SMALL["kara_window"] + 2 * KARA_SMALL["kara_period"]
    early = [m for m in retracted if GEN - m["retracted_at"] > room]
    assert early, [m["retracted_at"] for m in retracted]
    for meta in early:
        assert meta["kara"]["kv_physical_len"] < meta["kara"]["kv_logical_len"] - 100, (
            meta
        )


@pytest.mark.integration  # a retraction scenario on an engine of its own (docs/TESTING.md, tiers)
def test_retracted_request_keeps_its_own_budget(tiny_llama):
    """A budget-matched SnapKV request (``custom_params.kara.budget``) keeps its budget through a
    retraction. The request state used to be rebuilt by hand on retraction without the budget, so
    a re-prefilled request fell back to the server-wide N and grew to it unchecked.

    Server-wide N = 200 (C_max 216); each request asks for N = 24 (C_max 40). Two waves over a
    300-token pool (the tight-pool trick above) force retractions."""
    import asyncio

    with engine_env(SGLANG_INIT_NEW_TOKEN_RATIO="0.01"):
        engine = start_engine(
            "kara",
            tiny_llama,
            kara_policy="snapkv",
            kara_snapkv_threshold=216,
            kara_snapkv_budget=200,
            kara_snapkv_window=8,
            kara_query_source="capture",
            max_total_tokens=300,
            max_running_requests=12,
        )
    gen = 200
    params = {
        "max_new_tokens": gen,
        "min_new_tokens": gen,
        "temperature": 0.0,
        "custom_params": {"kara": {"budget": 24}},
    }

    async def run_one(prompt, started):
        last = None
        async for chunk in await engine.async_generate(prompt, params, stream=True):
            started.set()
            last = chunk
        return last

    async def run_all():
        waves = [
            [f"{p} {i}" for i in range(w, w + 2) for p in PROMPTS[:3]] for w in (0, 2)
        ]
        first_started = [asyncio.Event() for _ in waves[0]]
        first = [
            asyncio.create_task(run_one(p, e)) for p, e in zip(waves[0], first_started)
        ]
        await asyncio.gather(*(e.wait() for e in first_started))
        second = [asyncio.create_task(run_one(p, asyncio.Event())) for p in waves[1]]
        return await asyncio.gather(*first, *second)

    try:
        outs = engine.loop.run_until_complete(run_all())
    finally:
        engine.shutdown()
    assert all(o["meta_info"]["completion_tokens"] == gen for o in outs)
    retracted = [
        o["meta_info"] for o in outs if o["meta_info"].get("num_retractions", 0)
    ]
    assert retracted, "no request was retracted: the test did not exercise the path"
    for meta in (o["meta_info"] for o in outs):
        held = meta["kara"]["kv_physical_len"] - meta["prompt_tokens"]
        assert 24 <= held <= 40 + 1, (
            held,
            meta,
        )  # its own N..C_max, not the server's 200..216


@pytest.mark.integration  # an engine of its own configuration (docs/TESTING.md, tiers)
def test_buffer_scoring_recomputes_the_decoded_queries(tiny_llama, engines):
    """--kara-scoring buffer: a region's query window is the last U tokens of the window, and the
    recompute forward extends those alone (prefix = every row before them). On each request's
    first window its scores equal those from the captured decode-time queries (crosscheck)."""
    engine = kara_engine(
        engines, tiny_llama, "capture", extra={"kara_scoring": "buffer"}
    )
    outs = engine.generate(PROMPTS, GREEDY)
    for out in outs:
        kara = out["meta_info"]["kara"]
        assert kara["compressions"] >= 3
        assert kara["query_crosscheck_max_rel_err"] < 2e-2, kara[
            "query_crosscheck_max_rel_err"
        ]
