"""Spreading a window's scoring over the decode steps before its event (``--kara-spread``).

Scoring a Kara window takes its W queries (a recompute forward over W tokens, or W captured
queries) against its W - U region keys. Done whole at the event's due step (``--kara-spread off``,
the paper's schedule), that step carries the whole cost: on the default CPU server one 512-token
recompute takes ~20 decode steps' time, and requests that arrived together fall due together.
Eq. 4 is a sum over queries of a softmax over the region's keys, so once the keys are all
decoded (``policy.upcoming``: U + R steps before the window is due, at least) the window can be
scored a few queries per step and the parts added (``policy.additive``):

    step:      k ........................... due step D (first due step once the window is complete)
    keys:      all W - U decoded
    queries:   [f, f+W-U) decoded   | the last U arrive one per step
    scored:    on every stride-th step from the first (stride: the steps until D over the window's
               chunks of MIN_CHUNK; the first after a phase from the request's prompt), ceil(remaining / scoring steps left incl. this one) queries,
               at least MIN_CHUNK; under ``--kara-spread-max`` every step, at most the cap; never
               more than are decoded; at D whatever is left
    event:     at D, if every query is scored: select and compact (no scoring left to do)

Everything here depends on the request's own progress only (its decode-step count, its rows):
how a request is scored, and when it is compressed, do not depend on what else runs. With a cap
too small to finish by D, the compaction moves to the next due step by which it can (``deadline``);
``slack`` bounds that delay, and admission charges it (the request holds up to ``slack`` more
uncompressed rows). Without a cap (the default) no event is delayed.

The job lives on the request's row state (``KaraReqState.scoring``): a retraction drops it with
the row, a compaction of the region clears it. Its scores are the only memory it holds:
``[layers, H_kv, W - U]`` float32 per request (Llama-3-8B, W = 512: 0.5 MB).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sgl_kara.policies.base import Region, RowView
from sgl_kara.scheduler.jobs import Job, eligible
from sgl_kara.scheduler.state import KaraReqState

# A spread step scores at least this many queries of a window (fewer only when fewer are left or
# decoded), on every stride-th step: a step's scoring cost is mostly reading the region's keys
# (per layer), nearly the same for 4 queries as for 32 (SmolLM2's shapes on a 2-core CPU, 8
# requests x 30 layers: 54 ms for 4, 121 ms for 32, 2.7 s for the whole window of 512;
# python -m bench.score_parts). Under --kara-spread-max every step scores (at most the cap).
MIN_CHUNK = 32


@dataclass
class ScoringJob:
    """The scoring of one upcoming window, as far as it got."""

    region: Region
    done: int = 0  # queries scored: the first ``done`` of the region's query window
    scores: torch.Tensor | None = (
        None  # [layers, H_kv, M] float32, summed over the scored queries
    )
    start: int = (
        0  # the step count (``now``) at which the job's scoring steps are counted from
    )
    stride: int = (
        1  # it scores at steps start, start + stride, ... (and at its due step)
    )

    @property
    def remaining(self) -> int:
        return self.region.query_len - self.done

    def covers(self, region: Region) -> bool:
        """Is this the scoring of ``region`` (same rows, same queries, same kept count)?"""
        r = self.region
        return (r.start, r.length, r.keep, r.query_start, r.query_len) == (
            region.start,
            region.length,
            region.keep,
            region.query_start,
            region.query_len,
        )

    def add(self, scores: torch.Tensor, n: int) -> None:
        """``scores`` [layers, H_kv, M]: the next ``n`` queries' part."""
        self.scores = scores.clone() if self.scores is None else self.scores + scores
        self.done += n


def decoded(region: Region, length: int, done: int) -> int:
    """Queries of ``region`` past the first ``done`` whose tokens are decoded (rows < ``length``)."""
    return max(
        0,
        min(region.query_start + region.query_len, length)
        - (region.query_start + done),
    )


def chunk(
    remaining: int, available: int, steps_left: int, cap: int, least: int = 1
) -> int:
    """Queries to score now: the ``remaining`` spread evenly over this step and the ``steps_left``
    scoring steps after it, at least ``least`` (or all remaining), at most ``cap`` (0: no cap) and
    at most the ``available`` (decoded) ones."""
    if remaining <= 0 or available <= 0:
        return 0
    n = min(
        available, max(-(-remaining // (max(0, steps_left) + 1)), min(least, remaining))
    )
    return min(n, cap) if cap else n


def phase(req, stride: int) -> int:
    """Steps a job waits before its first part, in [0, stride): from the request's own prompt, so
    that requests in step (they arrived together) score on different steps, while a request's
    parts, and so its scores to the last bit, do not depend on what else runs."""
    return hash(tuple(req.origin_input_ids)) % stride if stride > 1 else 0


def stride_for(query_len: int, steps: int, cap: int) -> int:
    """Steps between a job's scoring steps: its ``query_len`` queries in chunks of MIN_CHUNK spread
    evenly over the ``steps`` (this one included) until its due step; 1 under a cap (every step)."""
    if cap:
        return 1
    return max(1, steps // max(1, -(-query_len // MIN_CHUNK)))


def deadline(policy, now: int, to_region: int, remaining: int, cap: int) -> int:
    """The due step at which the window is compressed: the first due step once the window is
    complete (``now + to_region``) by which ``remaining`` queries fit at ``cap`` per step
    (cap 0: the first)."""
    d = policy.next_due(now + max(0, to_region))
    if cap:
        while remaining > cap * (d - now + 1):
            d = policy.next_due(d + 1)
    return d


def first_lead(policy, limit: int = 1 << 24) -> int | None:
    """Steps between a request's first upcoming window becoming known and ``region`` naming it
    (Kara: U + R); None when the policy names no upcoming window early."""
    state = KaraReqState(protected=0, frontier=0)
    n = 1
    while n <= limit:
        up = policy.upcoming(RowView(0, 0, n, 0, state))
        if up is not None:
            # the smallest such length: step back to it (upcoming is monotone in the length)
            lo, hi = n // 2, n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (
                    (lo, mid)
                    if policy.upcoming(RowView(0, 0, mid, 0, state)) is not None
                    else (mid, hi)
                )
            return policy.upcoming(RowView(0, 0, hi, 0, state))[1]
        n *= 2
    return None


def slack(policy, cap: int) -> int:
    """Most decode steps a cap delays an event past the due step it would have had (0 without a
    cap): the window's queries take ceil(query_len / cap) steps from when its keys are known, the
    due step comes ``first_lead`` steps after that, a late event waits for a later due step."""
    lead = first_lead(policy)
    if not cap or lead is None:
        return 0
    state = KaraReqState(protected=0, frontier=0)
    region, _ = policy.upcoming(RowView(0, 0, 1 << 20, 0, state))
    late = -(-region.query_len // cap) - lead
    if late <= 0:
        return 0
    interval = policy.event_interval()
    return -(-late // interval) * interval


def spreads(policy, spread: str) -> bool:
    """Does this policy's scoring spread over decode steps under ``--kara-spread spread``?"""
    return spread == "even" and policy.needs_queries and policy.additive


def plan_chunks(
    policy, reqs, state_of, page_size: int, cap: int, now_of, on_protected=None
) -> list:
    """This step's spread scoring: ``[(Job, n)]``, the next ``n`` queries of each running request's
    upcoming window (a job is opened on the request's row state the first step its keys are all
    decoded). ``now_of(req)``: the count the policy's due steps are in (the request's own decoded
    tokens, or the scheduler's step under ``--kara-phase server``)."""
    out = []
    for i, req in enumerate(reqs):
        state = state_of(req)
        ok = eligible(req, state, page_size, on_protected)
        if ok is None:
            continue
        row, remaining = ok
        length = row.length
        up = policy.upcoming(row)
        if up is None:
            continue
        region, to_region = up
        job = state.scoring
        now = now_of(req)
        if job is None or not job.covers(region):
            ahead = dataclasses.replace(row, length=length + to_region)
            if not policy.worth_compressing(ahead, remaining - to_region):
                continue  # it finishes before this window would be compressed
            steps = deadline(policy, now, to_region, region.query_len, cap) - now + 1
            stride = stride_for(region.query_len, steps, cap)
            job = state.scoring = ScoringJob(
                region, start=now + phase(req, stride), stride=stride
            )
        if job.remaining <= 0:
            continue
        steps_left = deadline(policy, now, to_region, job.remaining, cap) - now
        if steps_left > 0 and (now < job.start or (now - job.start) % job.stride):
            continue  # not one of its scoring steps
        n = chunk(
            job.remaining,
            decoded(region, length, job.done),
            steps_left // job.stride,
            cap,
            MIN_CHUNK if not cap else 1,
        )
        if n:
            out.append((Job(i, req, state, region), n))
    return out
