"""Spread scoring (``--kara-spread``, scheduler/spread.py) without an engine: the arithmetic of
the per-step share, the deadline and the delay a cap adds; a step-by-step simulation of one
request's window against the schedule; and the additivity the spreading relies on (Eq. 4 scored
in parts and summed equals the whole, for the torch reference and the Triton kernel)."""

from __future__ import annotations

import types

import pytest
import torch

from sgl_kara.kernels.window_score import window_scores_paged, window_scores_paged_ref
from sgl_kara.policies.base import RowView
from sgl_kara.policies.kara import KaraOptions, KaraPolicy
from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy
from sgl_kara.scheduler.plan import (
    StepPlan,
    apply,
    decoded_tokens,
    plan_chunks,
    snapshot,
)
from sgl_kara.scheduler.spread import (
    MIN_CHUNK,
    ScoringJob,
    chunk,
    deadline,
    first_lead,
    phase,
    slack,
    spreads,
)
from sgl_kara.scheduler.state import KaraReqState

PAPER = KaraPolicy(KaraOptions())  # W 512, U 32, delta 128


def test_chunk_spreads_evenly_within_cap_and_what_is_decoded():
    assert chunk(512, 480, 127, 0) == 4  # 512 over 128 steps
    assert chunk(512, 480, 0, 0) == 480  # due now: everything decoded
    assert chunk(512, 480, 127, 3) == 3  # capped
    assert chunk(10, 2, 0, 0) == 2  # only decoded queries
    assert chunk(0, 100, 5, 0) == 0 and chunk(5, 0, 5, 0) == 0


def test_deadline_is_the_first_due_step_a_cap_can_meet():
    # first window of a request: keys complete at its 481st token, window complete at 513, due at 640
    assert first_lead(PAPER) == 32
    assert deadline(PAPER, 481, 32, 512, 0) == 640
    assert deadline(PAPER, 481, 32, 512, 4) == 640  # 160 steps x 4 >= 512
    assert deadline(PAPER, 481, 32, 512, 2) == 768  # 160 x 2 < 512 <= 288 x 2
    band = KaraPolicy(KaraOptions(recent=1024))
    assert first_lead(band) == 32 + 1024


def test_slack_is_what_a_cap_can_delay():
    assert slack(PAPER, 0) == 0
    assert slack(PAPER, 16) == 0  # 512 queries / 16 = 32 steps = U: always on time
    assert (
        slack(PAPER, 4) == 128
    )  # 128 steps from U = 32 before the due step: one period late
    assert slack(PAPER, 2) == 256
    buffer = KaraPolicy(KaraOptions(scoring="buffer"))
    assert slack(buffer, 1) == 0  # U queries, one decoded per step


def test_only_additive_query_scorers_spread():
    assert spreads(PAPER, "even") and not spreads(PAPER, "off")
    assert not spreads(
        SnapKVPolicy(SnapKVOptions()), "even"
    )  # pooled after the sum: not additive
    from sgl_kara.policies.random import RandomOptions, RandomPolicy

    assert not spreads(RandomPolicy(RandomOptions()), "even")  # scores without queries


class Req:
    def __init__(self, prompt: int, max_new: int):
        self.origin_input_ids = [0] * prompt
        self.output_ids = [7]  # the prefill's token
        self.sampling_params = types.SimpleNamespace(max_new_tokens=max_new)
        self.kv = types.SimpleNamespace(
            kv_committed_len=prompt, kv_allocated_len=prompt, cache_protected_len=0
        )
        self.kara = KaraReqState()
        self.to_finish = None

    def finished(self):
        return len(self.output_ids) >= self.sampling_params.max_new_tokens

    def step(self):
        self.output_ids.append(7)
        self.kv.kv_committed_len += 1
        self.kv.kv_allocated_len += 1


def _plan_chunks(policy, reqs, cap: int):
    """The step's spread parts as the runtime plans them, the plan's openings applied."""
    seen = snapshot(reqs, lambda r: r.kara, 1)
    chunks, opened = plan_chunks(policy, seen, cap, lambda r, s: decoded_tokens(r, s))
    apply(StepPlan(fixed=[s for s in seen if s.fixes], opened=opened))
    return chunks


def simulate(policy, cap: int, steps: int, others: int = 0, prompt: int = 9):
    """One request (plus ``others`` co-running ones started later) decoded ``steps`` steps with the
    runtime's plan per step (its spread parts, then the due check), compaction's effect on the
    row applied at each due step whose window is scored. Returns per step the queries scored for
    the first request and, per compression of it, the first due step at which its window was
    complete and the step at which it was compressed."""
    reqs = [Req(prompt, 10_000)]
    share, compressed, first_due = [], [], {}
    for t in range(steps):
        if t == 40 and others:
            reqs += [Req(prompt + i, 10_000) for i in range(others)]
        chunks = _plan_chunks(policy, reqs, cap)
        got = {id(j.req): n for j, n in chunks}
        for j, n in chunks:
            region, state = j.region, j.state
            assert (
                region.query_start + state.scoring.done + n <= j.req.kv.kv_committed_len
            )  # decoded only
            state.scoring.add(torch.zeros(1, 1, region.length), n)
        share.append(got.get(id(reqs[0]), 0))
        for r in reqs:
            s = r.kara
            if s.protected < 0 or not policy.schedule.due(decoded_tokens(r, s)):
                continue
            row = RowView(
                s.protected, s.frontier, r.kv.kv_committed_len, s.pos_offset, s
            )
            region = policy.region(row)
            if region is not None and r is reqs[0]:
                first_due.setdefault(region.start, decoded_tokens(r, s))
            if region is None or s.scoring is None or s.scoring.remaining > 0:
                continue
            d = region.length - region.keep
            r.kv.kv_committed_len -= d
            r.kv.kv_allocated_len -= d
            s.pos_offset += d
            s.frontier = region.start + region.keep
            s.scoring = None
            if r is reqs[0]:
                compressed.append((first_due[region.start], decoded_tokens(r, s)))
        for r in reqs:
            r.step()
    return share, compressed


def test_a_window_is_scored_evenly_until_its_due_step():
    policy = KaraPolicy(KaraOptions(window=64, buffer=8, period=16))
    share, compressed = simulate(policy, cap=0, steps=400)
    # keys [P, P+56) decoded at token 57, window complete at 65, due at 80: 24 steps of shares;
    # then 23 rows left (79 - 56), the next window complete at 121, due at 128
    assert [c for _, c in compressed][:3] == [80, 128, 192], compressed
    first = share[56:80]  # share[t] is the step feeding token t + 1
    # 64 queries in chunks of MIN_CHUNK (32) over the 24 steps: every 12th step, from the phase
    # the request's prompt gives
    p = phase(Req(9, 10).origin_input_ids, 12)
    assert 0 < p < 12 and [(i, n) for i, n in enumerate(first) if n] == [
        (p, 32),
        (p + 12, 32),
    ], first
    assert all(n <= MIN_CHUNK for n in share), max(share)
    # no cap: every window compressed at the first due step at which it is complete, as unspread
    assert all(due == done for due, done in compressed), compressed


def test_a_cap_delays_by_at_most_the_slack_and_never_skips_work():
    policy = KaraPolicy(KaraOptions(window=64, buffer=8, period=16))
    capped_share, capped = simulate(policy, cap=1, steps=600)
    assert max(capped_share) == 1
    s = slack(
        policy, 1
    )  # 64 queries at 1 per step, keys known 8 steps before due: 56 late -> 64
    assert s == 64
    delays = [done - due for due, done in capped]
    assert len(capped) >= 5 and all(0 <= x <= s for x in delays), capped
    assert max(delays) > 0  # the cap did delay


def test_queries_are_scored_only_once_decoded():
    from sgl_kara.scheduler.spread import decoded

    policy = KaraPolicy(KaraOptions(window=16, buffer=8, period=1))  # due at every step
    region, _ = policy.schedule.upcoming(
        RowView(4, 4, 12, 0, KaraReqState(protected=4, frontier=4))
    )
    assert (
        decoded(region, 12, 0) == 8
        and decoded(region, 12, 5) == 3
        and decoded(region, 20, 16) == 0
    )
    share, compressed = simulate(
        policy, cap=0, steps=60
    )  # asserts decoded-only at every chunk
    # 16 queries, one chunk's worth: at the first scoring step (the prompt's phase) all decoded by
    # then, the others at the due step
    p = phase(Req(9, 10).origin_input_ids, 9)
    assert share[8:17] == [0] * p + [8 + p] + [0] * (7 - p) + [8 - p] and compressed[
        0
    ] == (17, 17), share[8:17]


def test_a_request_is_scored_the_same_whatever_else_runs():
    policy = KaraPolicy(KaraOptions(window=64, buffer=8, period=16))
    alone = simulate(policy, cap=0, steps=300)
    crowded = simulate(policy, cap=0, steps=300, others=5)
    assert alone == crowded


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_scores_add_up_over_query_parts(use_triton, dtype):
    """Eq. 4 in parts: scoring queries [0, a) and [a, W) and adding equals scoring [0, W)."""
    g = torch.Generator().manual_seed(3)
    b, w, hq, hkv, d, m, s = 2, 40, 4, 2, 16, 28, 96
    q = torch.randn(b, w, hq, d, generator=g).to(dtype)
    k = torch.randn(s, hkv, d, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(s, generator=g)[:m] for _ in range(b)])
    fn = window_scores_paged if use_triton else window_scores_paged_ref
    whole = fn(q, k, slots) if not use_triton else fn(q, k, slots, use_triton=True)
    parts = torch.zeros_like(whole)
    for lo, hi in ((0, 7), (7, 8), (8, 33), (33, 40)):
        part = q[:, lo:hi].contiguous()
        parts += (
            fn(part, k, slots)
            if not use_triton
            else fn(part, k, slots, use_triton=True)
        )
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(parts, whole, rtol=tol, atol=tol * m)


def test_scoring_job_covers_only_its_own_region():
    policy = KaraPolicy(KaraOptions(window=64, buffer=8, period=16))
    state = KaraReqState(protected=4, frontier=4)
    region, to_region = policy.schedule.upcoming(RowView(4, 4, 60, 0, state))
    assert to_region == 64 - 56 and region.start == 4 and region.query_len == 64
    job = ScoringJob(region)
    assert job.covers(policy.region(RowView(4, 4, 68, 0, state)))
    state.request["retention"] = 0.5  # another kept count: another region
    assert not job.covers(policy.region(RowView(4, 4, 68, 0, state)))


def test_requests_in_step_score_their_parts_on_different_steps():
    """Eight requests that arrived together (same prompt length, different prompts) decode in step;
    their parts land on different steps (each request's phase comes from its own prompt), so no
    step scores all of them, and every window is still whole by its due step."""
    policy = KaraPolicy(KaraOptions(window=64, buffer=8, period=16))
    reqs = []
    for i in range(8):
        r = Req(9, 10_000)
        r.origin_input_ids = [i + 1, 2 * i + 3] + [0] * 7
        reqs.append(r)
    per_step = []
    for _t in range(80):
        chunks = _plan_chunks(policy, reqs, 0)
        for j, n in chunks:
            j.state.scoring.add(torch.zeros(1, 1, j.region.length), n)
        per_step.append(len(chunks))
        for r in reqs:
            r.step()
    assert sum(per_step) >= 16 and max(per_step) < 8, per_step  # 2 parts each
    assert all(
        r.kara.scoring.remaining == 0 for r in reqs
    )  # whole before the due step (80)
