"""Exactness of compressed decoding against an independent reference (tests/oracle.py).

After every compression event, each decode step's log-probabilities must equal those of the
Hugging Face model run over the whole sequence at its original positions with exactly the evicted
entries masked (per layer and KV head, from the event on) -- float32, so the tolerance is rounding.
Several events per request (growing pos_offset), page size 1 and 16, both query sources, Llama and
Qwen3 (tiny random models); SmolLM2 is marked slow. Every other policy (SnapKV's re-compression of
compacted rows included) goes through the same check in tests/test_policy_matrix.py.

Each run also checks that the oracle can fail: the reference *without* the evictions must be far
from the engine after the first event, and before it both references must agree with the engine.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import start_engine
from oracle import compare, load_reference, read_evictions, reference_logprobs

KARA = dict(kara_window=40, kara_buffer=8, kara_max_chunk=6, kara_period=4)
TOL = 2e-3  # float32: observed errors are ~1e-5 (tiny models) / ~1e-4 (SmolLM2)
GEN = {"max_new_tokens": 150, "temperature": 0.0, "ignore_eos": True}


def _prompts(vocab: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, vocab, (13 + 9 * i,), generator=g).tolist() for i in range(n)]


def run_and_check(model_path: str, tmp_path, page: int, query_source: str, policy: str = "kara",
                  extra: dict | None = None, gen: dict | None = None, integrity: bool = False,
                  keep_engine: bool = False, tol: float = TOL, env_extra: dict | None = None,
                  margin: float | None = None):
    """Generate with evictions recorded, then compare every step with the masked reference.
    ``margin`` (default 20 x tol): how far the unmasked reference must be off, so that the check
    is not vacuous; it measures the evictions' effect, not the engine's precision, so a bf16 run
    (wide tol) keeps the float32 margin. Returns (outputs, the engine if ``keep_engine`` else
    None, worst error, smallest unmasked gap)."""
    record = str(tmp_path / f"evictions_{policy}_{page}_{query_source}.jsonl")
    opts = dict(kara_policy=policy, kara_query_source=query_source, page_size=page)
    if policy == "kara":
        opts.update(KARA, kara_retention=0.25)
    opts.update(extra or {})
    env = {"KARA_RECORD_EVICTIONS": record}  # read by the spawned scheduler
    if integrity:
        env["KARA_CHECK_INTEGRITY"] = "1"
    env.update(env_extra or {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = start_engine("kara", model_path, **opts)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = _prompts(vocab)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=gen or GEN, return_logprob=True, top_logprobs_num=5)
        if not keep_engine:
            engine.shutdown()
        worst, control = _check_against_reference(model_path, prompts, outs, read_evictions(record), policy, page,
                                                  query_source, tol, margin)
    except BaseException:
        if keep_engine:
            engine.shutdown()
        raise
    return outs, engine if keep_engine else None, worst, control


def _check_against_reference(model_path, prompts, outs, events, policy, page, query_source, tol=TOL, margin=None):
    """Returns (worst |dlogprob| vs the masked reference, smallest gap of the unmasked control)."""
    model = load_reference(model_path)
    worst, controls = 0.0, []
    for prompt, out in zip(prompts, outs):
        rid_events = events.get(out["meta_info"]["id"], [])
        assert len(rid_events) >= 3, f"only {len(rid_events)} events: the test needs several (pos_offset > 0)"
        assert rid_events[-1]["logical_len"] > rid_events[0]["logical_len"]
        tokens = prompt + out["output_ids"]
        err = compare(reference_logprobs(model, tokens, rid_events), len(prompt), out)
        worst = max(worst, float(err.max()))
        assert float(err.max()) < tol, f"engine vs masked HF reference: max |dlogprob| {err.max():.2e} at step {int(err.argmax())}"
        # The oracle can fail: without the evictions the reference is far off after the first event.
        full = compare(reference_logprobs(model, tokens, []), len(prompt), out)
        first = rid_events[0]["logical_len"] - len(prompt) + 1  # first generated step after an event
        assert float(full[:first].max()) < tol  # identical before any eviction
        controls.append(float(full[first:].max()))
    margin = 20 * tol if margin is None else margin
    assert min(controls) > margin, f"evictions barely change the output here ({controls}); the check would be vacuous"
    print(f"\nORACLE {os.path.basename(model_path)} policy={policy} page={page} {query_source}: "
          f"max err {worst:.2e}, unmasked reference off by >= {min(controls):.2e}")
    return worst, min(controls)


@pytest.mark.parametrize("arch, page, query_source", [
    ("llama", 1, "capture"),
    ("llama", 16, "recompute"),
    ("qwen3", 1, "recompute"),
    ("qwen3", 16, "capture"),
])
def test_kara_matches_masked_reference(arch, page, query_source, tiny_llama, tiny_qwen3, tmp_path):
    run_and_check({"llama": tiny_llama, "qwen3": tiny_qwen3}[arch], tmp_path, page, query_source)


def test_buffer_scoring_matches_masked_reference(tiny_llama, tmp_path):
    """--kara-scoring buffer with recompute (a forward over the last U window tokens only)."""
    run_and_check(tiny_llama, tmp_path, 1, "recompute", extra=dict(kara_scoring="buffer"))


def test_requests_without_a_ring_row_fall_back_to_recompute(tiny_llama, tmp_path):
    """A capture ring with fewer rows than running requests (memory.ring_rows bounds it by the
    pool; ``--kara-query-ring-rows 1`` forces it here): the requests without a row are scored from
    recomputed queries while the row's holder is scored from the ring, in the same event (the
    jobs are split by source), and the decode stays exact. The two sources' queries differ in the
    last bits (a decode forward vs an extend forward), which can flip near-tied selections, so
    each request is checked against the run of its own source: the requests that never held the
    row evict exactly what a recompute run evicts, the row's holder what a full-ring capture run
    evicts, and both kinds occur."""
    import json

    def per_prompt(outs, query_source):
        events = read_evictions(str(tmp_path / f"evictions_kara_1_{query_source}.jsonl"))
        return [([(e["logical_len"], e["evicted"]) for e in events[o["meta_info"]["id"]]], o["output_ids"])
                for o in outs]

    trace = tmp_path / "trace.jsonl"
    fell_back = run_and_check(tiny_llama, tmp_path, 1, "capture", integrity=True, extra={"kara_query_ring_rows": 1},
                              env_extra={"KARA_TRACE": str(trace)})[0]
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert max(s["running"] for s in steps) == 3
    scored = sum(o["meta_info"]["kara"]["compressions"] for o in fell_back)
    assert 0 < steps[-1]["kara_recompute_fallbacks"] < scored  # some windows came from the ring
    mixed = per_prompt(fell_back, "capture")
    recomputed = per_prompt(run_and_check(tiny_llama, tmp_path, 1, "recompute")[0], "recompute")
    captured = per_prompt(run_and_check(tiny_llama, tmp_path, 1, "capture")[0], "capture")
    source = ["recompute" if m == r else "capture" if m == c else "neither"
              for m, r, c in zip(mixed, recomputed, captured)]
    assert "neither" not in source and set(source) == {"recompute", "capture"}, source


def test_recency_band_matches_masked_reference(tiny_llama, tmp_path):
    """--kara-recent R: exact against the masked reference with the capture ring alone (its
    capacity W + period + R still holds a window's queries when the window is finally scored: no
    recompute fallback), and no event evicts any of the newest R + U positions."""
    import json

    recent, buffer = 24, KARA["kara_buffer"]
    trace = tmp_path / "trace.jsonl"
    outs, _, _, _ = run_and_check(tiny_llama, tmp_path, 1, "capture", extra=dict(kara_recent=recent),
                                  integrity=True, env_extra={"KARA_TRACE": str(trace)})
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert steps[-1]["kara_recompute_fallbacks"] == 0
    events = read_evictions(str(tmp_path / "evictions_kara_1_capture.jsonl"))
    for out in outs:
        evs = events[out["meta_info"]["id"]]
        assert len(evs) >= 3
        for ev in evs:
            newest = max(p for layer in ev["evicted"] for head in layer for p in head)
            assert newest < ev["logical_len"] - recent - buffer, (newest, ev["logical_len"])


@pytest.mark.slow
@pytest.mark.parametrize("arch, page, query_source", [
    ("llama", 1, "recompute"),
    ("llama", 16, "capture"),
    ("qwen3", 1, "capture"),
    ("qwen3", 16, "recompute"),
])
def test_kara_matches_masked_reference_rest(arch, page, query_source, tiny_llama, tiny_qwen3, tmp_path):
    run_and_check({"llama": tiny_llama, "qwen3": tiny_qwen3}[arch], tmp_path, page, query_source)


@pytest.mark.slow
@pytest.mark.parametrize("page, query_source", [(1, "capture"), (16, "recompute")])
def test_smollm2_matches_masked_reference(page, query_source, tmp_path):
    from sgl_kara.models.default import default_model_path

    run_and_check(default_model_path(), tmp_path, page, query_source,
                  extra=dict(kara_window=128, kara_buffer=16, kara_period=16),
                  gen={"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True})
