"""Exactness of compressed decoding against an independent reference (tests/oracle.py).

After every compression event, each decode step's log-probabilities must equal those of the
Hugging Face model run over the whole sequence at its original positions with exactly the evicted
entries masked (per layer and KV head, from the event on) -- float32, so the tolerance is rounding.
Several events per request (growing pos_offset), page size 1 and 16, both query sources, Llama and
Qwen3 (tiny random models); SmolLM2 is marked slow. On the same engines, retention 1.0 per request
(every window scored, selected and compacted into fresh slots, nothing dropped) gives plain SGLang's
tokens. Every other policy (SnapKV's re-compression of
compacted rows included) goes through the same check in tests/test_policy_matrix.py.

Each run also checks that the oracle can fail: the reference *without* the evictions must be far
from the engine after the first event, and before it both references must agree with the engine.
"""

from __future__ import annotations

import pytest
from oracle import (
    KARA,
    TEXT_GEN,
    TEXT_GREEDY,
    TEXT_PROMPTS,
    engine_options,
    read_evictions,
    record_path,
    run_and_check,
    shared_engine,
)

# the tier run on SGLang with the upstream series applied too (docs/TESTING.md)
pytestmark = pytest.mark.patched

# The shared engines' configurations (tests/oracle.py ``shared_engine``), each checked against the
# masked reference and, at retention 1.0 per request, against plain SGLang's tokens. The parameters
# are module-scoped: pytest runs one configuration's tests together, on one engine start.
ORACLE = [
    ("llama", 16, "recompute", "bidirectional"),
    ("qwen3", 1, "recompute", "bidirectional"),
    ("qwen3", 16, "capture", "bidirectional"),
    ("llama", 1, "capture", "bidirectional"),
]
BUFFER = ("llama", 1, "recompute", "buffer")
CONFIG = "arch, page, query_source, scoring"

PROMPTS, GEN, GREEDY = TEXT_PROMPTS, TEXT_GEN, TEXT_GREEDY
FULL = {
    **GREEDY,
    "custom_params": {"kara": {"retention": 1.0}},
}  # per request: every entry kept


def _extra(scoring: str) -> dict | None:
    return None if scoring == "bidirectional" else {"kara_scoring": scoring}


@pytest.fixture(scope="module")
def vanilla(tiny_llama, tiny_qwen3, engines):
    """Plain SGLang's greedy texts for PROMPTS on both tiny models, from the session's pool (a
    pooled start leaves the shared Kara engines running)."""
    return {
        name: [o["text"] for o in engines("sglang", path).generate(PROMPTS, GREEDY)]
        for name, path in (("llama", tiny_llama), ("qwen3", tiny_qwen3))
    }


@pytest.mark.parametrize(CONFIG, ORACLE, scope="module")
def test_kara_matches_masked_reference(
    arch, page, query_source, scoring, tiny_llama, tiny_qwen3, tmp_path, engines
):
    run_and_check(
        {"llama": tiny_llama, "qwen3": tiny_qwen3}[arch],
        tmp_path,
        page,
        query_source,
        extra=_extra(scoring),
        engines=engines,
    )


@pytest.mark.parametrize(CONFIG, [BUFFER], scope="module")
def test_buffer_scoring_matches_masked_reference(
    arch, page, query_source, scoring, tiny_llama, tmp_path, engines
):
    """--kara-scoring buffer with recompute (a forward over the last U window tokens only)."""
    run_and_check(
        tiny_llama, tmp_path, page, query_source, extra=_extra(scoring), engines=engines
    )


@pytest.mark.parametrize(CONFIG, [*ORACLE, BUFFER], scope="module")
def test_full_retention_is_token_identical(
    arch, page, query_source, scoring, vanilla, tiny_llama, tiny_qwen3, engines
):
    """Retention 1.0 for these requests (``custom_params.kara``): every window still goes through
    scoring, selection and compaction into fresh slots (at page size 16, the kept entries and the
    shifted tail go to fresh page-aligned pages), and the tokens are plain SGLang's."""
    engine, _ = shared_engine(
        engines,
        tiny_llama if arch == "llama" else tiny_qwen3,
        page,
        query_source,
        extra=_extra(scoring),
    )
    outs = engine.generate(PROMPTS, FULL)
    for out, ref in zip(outs, vanilla[arch]):
        meta = out["meta_info"]
        assert meta["completion_tokens"] == GEN
        assert meta["kara"]["compressions"] >= 6, meta["kara"]
        # retention 1.0 keeps every entry: physical == logical, yet every window went through
        # fresh-slot compaction.
        assert meta["kara"]["kv_physical_len"] == meta["kara"]["kv_logical_len"]
        assert out["text"] == ref


@pytest.mark.integration  # engines of their own configurations (docs/TESTING.md, tiers)
def test_requests_without_a_ring_row_fall_back_to_recompute(
    tiny_llama, tmp_path, engines
):
    """A capture ring with fewer rows than running requests (memory.ring_rows bounds it by the
    pool; ``--kara-query-ring-rows 1`` forces it here): the requests without a row are scored from
    recomputed queries while the row's holder is scored from the ring, in the same event (the
    jobs are split by source), and the decode stays exact. The two sources' queries differ in the
    last bits (a decode forward vs an extend forward), which can flip near-tied selections, so
    each request is checked against the run of its own source: the requests that never held the
    row evict exactly what a recompute run evicts, the row's holder what a full-ring capture run
    evicts, and both kinds occur."""
    import json

    def per_prompt(outs, query_source, extra=None, env_extra=None):
        record = record_path(
            tiny_llama, engine_options("kara", query_source, 1, extra), env_extra
        )
        events = read_evictions(record)
        return [
            (
                [
                    (e["logical_len"], e["evicted"])
                    for e in events[o["meta_info"]["id"]]
                ],
                o["output_ids"],
            )
            for o in outs
        ]

    trace = {"KARA_TRACE": str(tmp_path / "trace.jsonl")}
    ring1 = {"kara_query_ring_rows": 1}
    fell_back = run_and_check(
        tiny_llama,
        tmp_path,
        1,
        "capture",
        extra=ring1,
        env_extra=trace,
        engines=engines,
    )[0]
    steps = [
        json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()
    ]
    assert max(s["running"] for s in steps) == 3
    scored = sum(o["meta_info"]["kara"]["compressions"] for o in fell_back)
    assert (
        0 < steps[-1]["kara_recompute_fallbacks"] < scored
    )  # some windows came from the ring
    mixed = per_prompt(fell_back, "capture", ring1, trace)
    recomputed = per_prompt(
        run_and_check(tiny_llama, tmp_path, 1, "recompute", engines=engines)[0],
        "recompute",
    )
    captured = per_prompt(
        run_and_check(tiny_llama, tmp_path, 1, "capture", engines=engines)[0], "capture"
    )
    source = [
        "recompute" if m == r else "capture" if m == c else "neither"
        for m, r, c in zip(mixed, recomputed, captured)
    ]
    assert "neither" not in source and set(source) == {"recompute", "capture"}, source


@pytest.mark.integration  # engines of their own configurations (docs/TESTING.md, tiers)
def test_recency_band_matches_masked_reference(tiny_llama, tmp_path, engines):
    """--kara-recent R: exact against the masked reference with the capture ring alone (its
    capacity W + period + R still holds a window's queries when the window is finally scored: no
    recompute fallback), and no event evicts any of the newest R + U positions."""
    import json

    recent, buffer = 24, KARA["kara_buffer"]
    extra, env_extra = (
        dict(kara_recent=recent),
        {"KARA_TRACE": str(tmp_path / "trace.jsonl")},
    )
    outs, _, _, _ = run_and_check(
        tiny_llama,
        tmp_path,
        1,
        "capture",
        extra=extra,
        env_extra=env_extra,
        engines=engines,
    )
    steps = [
        json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()
    ]
    assert steps[-1]["kara_recompute_fallbacks"] == 0
    events = read_evictions(
        record_path(tiny_llama, engine_options("kara", "capture", 1, extra), env_extra)
    )
    for out in outs:
        evs = events[out["meta_info"]["id"]]
        assert len(evs) >= 3
        for ev in evs:
            newest = max(p for layer in ev["evicted"] for head in layer for p in head)
            assert newest < ev["logical_len"] - recent - buffer, (
                newest,
                ev["logical_len"],
            )


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, page, query_source",
    [
        ("llama", 1, "recompute"),
        ("llama", 16, "capture"),
        ("qwen3", 1, "capture"),
        ("qwen3", 16, "recompute"),
    ],
)
def test_kara_matches_masked_reference_rest(
    arch, page, query_source, tiny_llama, tiny_qwen3, tmp_path
):
    run_and_check(
        {"llama": tiny_llama, "qwen3": tiny_qwen3}[arch], tmp_path, page, query_source
    )


@pytest.mark.slow
@pytest.mark.parametrize("page, query_source", [(1, "capture"), (16, "recompute")])
def test_smollm2_matches_masked_reference(page, query_source, tmp_path):
    from sgl_kara.cpu.smollm2 import default_model_path

    run_and_check(
        default_model_path(),
        tmp_path,
        page,
        query_source,
        extra=dict(kara_window=128, kara_buffer=16, kara_period=16),
        gen={"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
    )
