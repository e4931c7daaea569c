"""Events keep up with any number of running requests: every due request whose uncompressed tail
would outgrow what admission charged it (``schedule.tail_charge``) before the next due step is in
the event, beyond ``--kara-max-seqs``; the paper's 30 stays the limit where it suffices.

The rule (plan.choose), a step-by-step simulation of the schedule over plan_jobs, and an engine run
with the tiny model: every request's largest tail within the charge, no retraction with a pool
sized to the compressed footprint, a bounded number of events per step."""

from __future__ import annotations

import json
import os
import random
import tempfile

import pytest
from support import FakeReq, flush_when_idle, start_engine

from sgl_kara.policies.base import RowView
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy
from sgl_kara.scheduler.plan import (
    MAX_CATCH_UP_PASSES,
    StepPlan,
    apply,
    choose,
    decoded_tokens,
    due_at,
    overdue,
    plan_jobs,
    snapshot,
)
from sgl_kara.scheduler.state import KaraReqState


# ------------------------------------------------------------------ the rule
def test_overdue():
    assert overdue(41, 40 + 8, 8) and not overdue(40, 40 + 8, 8)
    assert not overdue(10_000, None, 8)  # no bound: max_seqs alone limits


def test_choose_keeps_max_seqs_where_it_suffices():
    tails = [33, 40, 36, 32, 38]  # W = 32, period = 8: charge 40, overdue iff tail > 32
    assert choose(tails, [40] * 5, 8, max_seqs=30) == [1, 4, 2, 0, 3]
    assert choose([32, 32, 32], [40] * 3, 8, max_seqs=2) == [
        0,
        1,
    ]  # none overdue: the paper's limit
    assert choose(tails, [None] * 5, 8, max_seqs=2) == [1, 4]


def test_choose_takes_every_overdue_request_beyond_max_seqs():
    tails = [40, 32, 33, 32, 39, 35]
    assert choose(tails, [40] * 6, 8, max_seqs=2) == [0, 4, 5, 2]
    # overdue ones are taken even when a non-overdue tail is longer (per-request charges)
    assert choose([50, 45], [100, 40], 8, max_seqs=1) == [1]
    assert choose([50, 45], [100, 40], 8, max_seqs=2) == [0, 1]


def test_tail_charges_match_the_footprints():
    kara = KaraPolicy(KaraOptions(window=32, buffer=4, period=8))
    row = RowView(8, 8, 48, 0, KaraReqState())
    assert (
        kara.schedule.tail_charge(row)
        == 40
        == kara.schedule.footprint(10_000, None) - (10_000 * 7 + 27) // 28
    )
    snap = SnapKVPolicy(SnapKVOptions(threshold=40, budget=20, window=4))
    # footprint charges C_max + 1 = 41 generated entries; 16 of them are kept entries below f
    assert (
        snap.schedule.tail_charge(RowView(8, 8 + 16, 60, 0, KaraReqState())) == 41 - 16
    )
    assert snap.schedule.footprint(10_000, None) == 41


# ------------------------------------------------------------------ the schedule, simulated
def simulate(
    n: int,
    max_seqs: int,
    window=32,
    buffer=4,
    period=8,
    max_new=120,
    stagger=3,
    seed=0,
    phase="request",
    prompts=None,
    recent=0,
) -> dict:
    """Decode steps over due_at and plan_jobs (the runtime's two calls) with compaction's effect on
    the rows (events.py _shrink): requests arrive ``stagger`` at a time per step; returns the
    largest tail seen before an event against the charge, the requests compressed per event, and
    per request the own generated-token counts at which it was compressed."""
    policy = KaraPolicy(
        KaraOptions(window=window, buffer=buffer, period=period, recent=recent)
    )
    rng = random.Random(seed)
    pending = [
        FakeReq(i, prompt=p, max_new=max_new, kara=KaraReqState())
        for i, p in enumerate(prompts or [rng.randint(4, 12) for _ in range(n)])
    ][::-1]
    order = pending[::-1]
    running, step, max_tail, per_event = [], 0, 0, []
    compressed_at = {id(r): [] for r in pending}
    while pending or running:
        running += [pending.pop() for _ in range(min(stagger, len(pending)))]
        step += 1
        for r in running:
            if r.kara.protected >= 0:
                max_tail = max(max_tail, r.kv.kv_committed_len - r.kara.frontier)
        if phase == "request" or policy.schedule.due(step):
            seen = snapshot(running, lambda r: r.kara, 1)
            apply(StepPlan(fixed=[s for s in seen if s.fixes]))
            jobs = plan_jobs(
                policy,
                seen,
                max_seqs,
                due=lambda r, s, step=step: due_at(policy, phase, step, r, s),
            )
            if jobs:
                per_event.append(len(jobs))
            for j in jobs:
                d = j.region.length - j.region.keep
                j.req.kv.kv_committed_len -= d
                j.req.kv.kv_allocated_len -= d
                j.state.frontier = j.region.start + j.region.keep
                j.state.pos_offset += d
                compressed_at[id(j.req)].append(
                    decoded_tokens(j.req, j.state)
                )  # its own count: a due step
        for r in running:
            r.output_ids.append(1)
            r.kv.kv_committed_len += 1
            r.kv.kv_allocated_len += 1
        running = [r for r in running if not r.finished()]
    return dict(
        max_tail=max_tail,
        charge=window + recent + period,
        max_per_event=max(per_event),
        per_event=per_event,
        steps=step,
        events=len(per_event),
        compressed_at=[compressed_at[id(r)] for r in order],
    )


@pytest.mark.parametrize("phase", ["request", "server"])
@pytest.mark.parametrize("n, max_seqs", [(256, 30), (64, 4), (16, 30)])
def test_simulated_tails_stay_within_the_charge(n, max_seqs, phase):
    r = simulate(n, max_seqs, phase=phase)
    assert r["max_tail"] <= r["charge"], r
    assert r["max_per_event"] <= n, r


@pytest.mark.parametrize("recent", [0, 16])
def test_max_seqs_binds_with_the_recency_band(recent):
    """``--kara-max-seqs`` binds where a due request can wait for the next due step within its
    charge: its tail is W + R at its due step, and admission charged W + R + period (the band
    included: ``tail_charge`` is what ``footprint`` charged). 16 requests arriving together (W 31,
    period 8: due at 48 of their tokens, tail W + R) fall due together, none overdue; the first
    event takes 2; those left out are overdue at the next due step and taken then; no tail ever
    outgrows its charge. With the band left out of the charge every due request would be
    overdue at R > 0 and all 16 taken at once."""
    r = simulate(
        16, 2, window=31, stagger=16, prompts=[8] * 16, recent=recent, max_new=200
    )
    assert r["per_event"][:2] == [2, 14], r["per_event"]
    assert r["max_tail"] <= r["charge"], r
    policy = KaraPolicy(KaraOptions(window=31, buffer=4, period=8, recent=recent))
    row = RowView(8, 8, 48, 0, KaraReqState())
    assert policy.schedule.tail_charge(row) == 31 + recent + 8
    # the uncompressed tail footprint() admits beyond the compressed windows' entries
    kept = -(-27 // 4)  # kept_count(27, 0.25): ceil(0.25 x 27)
    compressed = -(-10_000 * kept // 27)
    assert (
        policy.schedule.tail_charge(row)
        == policy.schedule.footprint(10_000, None) - compressed
    )


def test_paper_limit_suffices_below_its_break_even():
    """16 running requests need 16 x 8 / 28 < 5 compressions per event: 30 is never exceeded."""
    assert simulate(16, 30)["max_per_event"] <= 30
    assert simulate(16, 30, phase="server")["max_per_event"] <= 30


def test_request_phase_compresses_a_request_at_its_own_steps_whenever_it_arrives():
    """Eight identical requests arriving one per step: with --kara-phase request each is compressed
    at the same own generated-token counts (so identical greedy requests answer alike); with
    server the counts depend on the arrival step, and the events are fewer and larger."""
    same = dict(n=8, max_seqs=30, stagger=1, prompts=[8] * 8)
    mine = simulate(**same, phase="request")["compressed_at"]
    assert len(mine[0]) >= 3 and all(c == mine[0] for c in mine), mine
    assert all(k % 8 == 0 for k in mine[0]), mine[0]
    server = simulate(**same, phase="server")
    assert len({tuple(c) for c in server["compressed_at"]}) > 1, server["compressed_at"]
    assert server["events"] < simulate(**same, phase="request")["events"]


# ------------------------------------------------------------------ the engine
W, U, PERIOD, RETENTION, GEN, PROMPT = 32, 4, 8, 0.25, 120, 8


def footprint_pool(n: int) -> int:
    """Slots for n requests at their compressed footprint (what admission charges), plus one
    decode step's allocation for each."""
    policy = KaraPolicy(
        KaraOptions(window=W, buffer=U, period=PERIOD, retention=RETENTION)
    )
    return n * (PROMPT + policy.schedule.footprint(GEN, None) + 1)


def run_schedule(model: str, n: int, max_seqs: int) -> dict:
    """n requests of PROMPT tokens and GEN outputs at once; figures from the responses and the
    per-step trace (KARA_TRACE)."""
    trace = tempfile.mktemp(suffix=".jsonl")
    saved = os.environ.get("KARA_TRACE")
    os.environ["KARA_TRACE"] = trace
    try:
        eng = start_engine(
            "kara",
            model,
            kara_window=W,
            kara_buffer=U,
            kara_period=PERIOD,
            kara_retention=RETENTION,
            kara_max_seqs=max_seqs,
            max_running_requests=n,
            max_total_tokens=footprint_pool(n),
            chunked_prefill_size=4096,
            kara_query_source="capture",
        )
    finally:
        os.environ.pop("KARA_TRACE") if saved is None else os.environ.__setitem__(
            "KARA_TRACE", saved
        )
    rng = random.Random(0)
    ids = [[rng.randint(10, 200) for _ in range(PROMPT)] for _ in range(n)]
    try:
        outs = eng.generate(
            input_ids=ids,
            sampling_params={
                "max_new_tokens": GEN,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
    finally:
        eng.shutdown()
    rows = [json.loads(line) for line in open(trace)]
    os.unlink(trace)
    events = [b["kara_events"] - a["kara_events"] for a, b in zip(rows, rows[1:])]
    metas = [o["meta_info"] for o in outs]
    return dict(
        requests=n,
        max_seqs=max_seqs,
        steps=len(rows),
        max_running=max(r["running"] for r in rows),
        max_tail=max(m["kara"]["kv_tail_peak"] for m in metas),
        charge=W + PERIOD,
        retractions=sum(m.get("num_retractions", 0) or 0 for m in metas)
        + rows[-1]["retracted"],
        events=rows[-1]["kara_events"],
        max_events_per_step=max(events or [0]),
        finished=sum(m["completion_tokens"] == GEN for m in metas),
        compressions_min=min(m["kara"]["compressions"] for m in metas),
    )


def _check(r: dict) -> None:
    assert r["finished"] == r["requests"], r
    assert r["max_tail"] <= r["charge"], r
    assert r["retractions"] == 0, r
    assert 1 <= r["max_events_per_step"] <= 8, (
        r
    )  # one event per due step, plus catch-up passes
    assert r["compressions_min"] >= 3, r  # several windows each


@pytest.mark.integration  # a load run: 256 requests on an engine of its own (docs/TESTING.md, tiers)
def test_engine_events_keep_up_with_256_requests(tiny_llama):
    """256 running requests at max_seqs 30 (256 x 8 / 28 = 73 due per event in steady state)."""
    r = run_schedule(tiny_llama, 256, 30)
    print(r)
    _check(r)


@pytest.mark.integration  # an engine per phase (docs/TESTING.md, tiers)
@pytest.mark.parametrize("phase", ["request", "server"])
def test_engine_identical_requests_answer_alike_whenever_they_arrive(tiny_llama, phase):
    """One greedy request run twice, alone, with a 3-token request between (2 decode steps, so the
    scheduler's step count moves off the period): with --kara-phase request both runs are compressed
    at the same own steps and answer alike, token for token; with server the second run's events
    fall at other steps of its answer (its meta_info.kara differs), which is what request fixes."""
    eng = start_engine(
        "kara",
        tiny_llama,
        kara_window=W,
        kara_buffer=U,
        kara_period=PERIOD,
        kara_retention=RETENTION,
        kara_phase=phase,
        max_total_tokens=2048,
    )
    params = {"max_new_tokens": GEN, "temperature": 0.0, "ignore_eos": True}
    prompt = [random.Random(1).randint(10, 200) for _ in range(PROMPT)]
    try:
        runs = []
        for filler in (False, True):
            if filler:
                eng.generate(
                    input_ids=[11, 12, 13],
                    sampling_params={**params, "max_new_tokens": 3},
                )
            assert flush_when_idle(eng)  # the second run prefills as the first did
            runs.append(eng.generate(input_ids=prompt, sampling_params=params))
    finally:
        eng.shutdown()
    metas = [r["meta_info"]["kara"] for r in runs]
    assert all(m["compressions"] >= 3 for m in metas), metas
    if phase == "request":
        assert runs[0]["output_ids"] == runs[1]["output_ids"]
        assert metas[0] == metas[1], metas
    else:
        assert metas[0] != metas[1], metas


def test_the_plan_holds_the_catch_up_passes():
    """A request re-prefilled with three complete windows behind it (after a retraction) beside
    one with a single window due: one plan holds three passes, each on the rows the previous
    pass leaves (the frontier K further, M - K rows fewer, the offset M - K higher); a job of a
    later pass runs only once its request's rows are those it was planned on (the previous pass
    committed it)."""
    import types

    import torch

    from sgl_kara.scheduler.plan import Planner

    policy = KaraPolicy(KaraOptions(window=16, buffer=4, period=4, retention=0.25))
    cfg = types.SimpleNamespace(
        phase="request", spread="off", spread_max=0, max_seqs=30, trigger="schedule"
    )
    parts = types.SimpleNamespace(
        page_size=1, req_to_token=torch.zeros(1, 1), overlap=False
    )
    backlog = FakeReq(0, prompt=8, generated=51, max_new=1000, kara=KaraReqState())
    one = FakeReq(1, prompt=8, generated=19, max_new=1000, kara=KaraReqState())
    plan = Planner(policy, cfg, parts).plan([backlog, one], lambda r: r.kara, 1)
    apply(plan)
    assert [[j.req for j in p] for p in plan.passes] == [
        [backlog, one],
        [backlog],
        [backlog],
    ]
    k, m = 3, 12  # K = ceil(0.25 * 12)
    for n, p in enumerate(plan.passes):
        job = p[0]
        assert (job.region.start, job.region.length, job.region.keep) == (
            8 + n * k,
            m,
            k,
        )
        row = job.planned
        assert (row.frontier, row.length, row.pos_offset) == (
            8 + n * k,
            59 - n * (m - k),
            n * (m - k),
        )
        assert job.as_planned() == (n == 0)
    # the first pass commits the backlog's window: the second pass's job is as planned
    backlog.kv.kv_committed_len -= m - k
    backlog.kara.frontier += k
    backlog.kara.pos_offset += m - k
    assert plan.passes[1][0].as_planned() and not plan.passes[2][0].as_planned()
    # at most MAX_CATCH_UP_PASSES passes
    long = FakeReq(
        2, prompt=8, generated=16 * 20 + 3, max_new=1000, kara=KaraReqState()
    )
    plan = Planner(policy, cfg, parts).plan([long], lambda r: r.kara, 1)
    assert len(plan.passes) == MAX_CATCH_UP_PASSES
