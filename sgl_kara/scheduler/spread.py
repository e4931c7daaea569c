"""Spreading a window's scoring over the decode steps before its event (``--kara-spread``): the
arithmetic of it (which step scores how many queries); plan.py decides with it, scoring.py
scores.

Scoring a Kara window takes its W queries (a recompute forward over W tokens, or W captured
queries) against its W - U region keys. Done whole at the event's due step (``--kara-spread
off``, the paper's schedule), that step carries the whole cost, and requests that arrived
together fall due together. Eq. 4 is a sum over queries of a softmax over the region's keys, so
once the keys are all decoded (``schedule.upcoming``: U + R steps before the window is due, at
least) the window can be scored a part per step and the parts added (``policy.additive``):

    step:      k ........................... due step D (first due step once the window is complete)
    keys:      all W - U decoded
    queries:   [f, f+W-U) decoded   | the last U arrive one per step
    scored:    on every stride-th step from the first (stride: the steps until D over the
               window's parts of ``part_size`` queries; the first after a phase from the
               request's prompt), ceil(remaining / scoring steps left incl. this one) queries,
               at least a part; under ``--kara-spread-max`` every step, at most the cap; never
               more than are decoded; at D whatever is left
    event:     at D, if every query is scored: select and compact (no scoring left to do)

Everything here depends on the request's own progress only (its decode-step count, its rows):
how a request is scored, and when it is compressed, do not depend on what else runs. With a cap
too small to finish by D, the compaction moves to the next due step by which it can (``deadline``);
``slack`` bounds that delay, and admission charges it (the request holds up to ``slack`` more
uncompressed rows). Without a cap (the default) no event is delayed.

The part size is the device's: a part costs about as much as reading the region's keys (CPU:
the keys are read per layer whatever the part; CUDA: a forward of fewer tokens than the
roofline's ridge costs a whole weight read), so parts are as large as that cost allows
(docs/GPU.md, "Scoring cost on a GPU"): PART_SIZE queries per request.

The job lives on the request's row state (``KaraReqState.scoring``): a retraction drops it with
the row, a compaction of the region clears it. Its scores are the only memory it holds:
``[layers, H_kv, W - U]`` float32 per request (memory_plan.py counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kara.policies.base import Region, RowView
from sgl_kara.scheduler.state import KaraReqState

# Queries per request a spread part scores at least (fewer only when fewer are left or decoded),
# by device: on a CPU a part's cost is mostly reading the region's keys per layer
# (bench/results/serving.md, Score parts); on CUDA a recompute forward below the roofline ridge
# costs a whole weight read (bench scoring_cost: 256 on H100 / H200). Under --kara-spread-max
# every step scores (at most the cap).
PART_SIZE = {"cpu": 32, "cuda": 256}
MIN_CHUNK = PART_SIZE["cpu"]


def part_size(device_type: str) -> int:
    return PART_SIZE.get(device_type, MIN_CHUNK)


@dataclass
class ScoringJob:
    """The scoring of one upcoming window, as far as it got."""

    region: Region
    done: int = 0  # queries scored: the first ``done`` of the region's query window
    # [layers, H_kv, M] float32, summed over the scored queries
    scores: torch.Tensor | None = None
    # the step count (``now``) at which the job's scoring steps are counted from
    start: int = 0
    # it scores at steps start, start + stride, ... (and at its due step)
    stride: int = 1

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


def phase(prompt_ids, stride: int) -> int:
    """Steps a job waits before its first part, in [0, stride): from the request's own prompt,
    so that requests in step (they arrived together) score on different steps, while a
    request's parts, and so its scores to the last bit, do not depend on what else runs."""
    return hash(tuple(prompt_ids)) % stride if stride > 1 else 0


def stride_for(query_len: int, steps: int, cap: int, part: int = MIN_CHUNK) -> int:
    """Steps between a job's scoring steps: its ``query_len`` queries in parts of ``part``
    spread evenly over the ``steps`` (this one included) until its due step; 1 under a cap."""
    if cap:
        return 1
    return max(1, steps // max(1, -(-query_len // part)))


def deadline(policy, now: int, to_region: int, remaining: int, cap: int) -> int:
    """The due step at which the window is compressed: the first due step once the window is
    complete (``now + to_region``) by which ``remaining`` queries fit at ``cap`` per step
    (cap 0: the first)."""
    d = policy.schedule.next_due(now + max(0, to_region))
    if cap:
        while remaining > cap * (d - now + 1):
            d = policy.schedule.next_due(d + 1)
    return d


def first_lead(policy, limit: int = 1 << 24) -> int | None:
    """Steps between a request's first upcoming window becoming known and ``region`` naming it
    (Kara: U + R); None when the policy names no upcoming window early."""
    state = KaraReqState(protected=0, frontier=0)
    n = 1
    while n <= limit:
        up = policy.schedule.upcoming(RowView(0, 0, n, 0, state))
        if up is not None:
            # the smallest such length: step back to it (upcoming is monotone in the length)
            lo, hi = n // 2, n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (
                    (lo, mid)
                    if policy.schedule.upcoming(RowView(0, 0, mid, 0, state))
                    is not None
                    else (mid, hi)
                )
            return policy.schedule.upcoming(RowView(0, 0, hi, 0, state))[1]
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
    region, _ = policy.schedule.upcoming(RowView(0, 0, 1 << 20, 0, state))
    late = -(-region.query_len // cap) - lead
    if late <= 0:
        return 0
    interval = policy.schedule.event_interval()
    return -(-late // interval) * interval


def spreads(policy, spread: str) -> bool:
    """Does this policy's scoring spread over decode steps under ``--kara-spread spread``?"""
    return spread == "even" and policy.needs_queries and policy.additive
