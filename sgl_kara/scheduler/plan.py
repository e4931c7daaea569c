"""What a decode step's compression work is: the one place that decides which windows are scored
now and which requests an event compresses (``Planner.plan``).

Which requests are due (``due_at``): with ``--kara-phase request`` (the default) a request is due
when its own generated-token count is a due step of the policy, so the steps at which it is
compressed, and therefore its answer, depend on its own progress only (two identical greedy
requests answer alike whatever else runs and whenever they arrived); with ``server`` every
request is due at the scheduler's due steps (the paper's schedule: all requests in step, fewer
and larger events).

A request takes part once its row has reached its protected length P (fixed here, at the first
check after the prefill: the tree-owned prefix and the prompt, rounded up to a page), when it is
not finishing anyway (``schedule.worth_compressing``: Kara leaves a request whose uncompressed
tail stays within W + period until its max_new_tokens), and when its KV is fully committed.
A request's own count (``decoded_tokens``) is the same under SGLang's normal and overlap
schedulers, so it is compressed at the same steps under both.

An event takes the due requests' regions, longest uncompressed tail first, at most ``max_seqs``
of them -- and more when more are overdue (``choose``): a due request whose tail, left to the
next due step, would outgrow what admission charged it (``schedule.tail_charge``) is always in the
event, so events keep up with any number of running requests (at max_seqs = 30 and one event per
period = 128 steps, the paper's limit holds up to ~30 x (W - U) / period = 112 running requests
at W = 512, U = 32).

With spread scoring (spread.py) a due window whose scoring is still under way waits for a later
due step, unless its tail would outgrow its charge (``ready``); a window with no spread job (a
backlog after a retraction, a job dropped) is scored whole at its event.

Catch-up: a request still due on the rows its compression leaves (re-prefilled after a retraction,
left out by max_seqs, a backlog deferred under trigger=pressure / headroom) is compressed again
in the same step. The plan holds every pass at once (``StepPlan.passes``): each pass's rows are
those the previous pass's commit leaves (``compressed``: frontier start + K, M - K rows fewer,
the offset raised by as many), at most ``MAX_CATCH_UP_PASSES`` (``MAX_PRESSURE_PASSES`` under
pressure) in all; a job of a later pass runs only if its rows are still the ones it was planned
on (``Job.as_planned``: the previous pass committed it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sgl_kara import _sglang as adapter
from sgl_kara.mem_cache.compaction import fresh_slots_needed
from sgl_kara.policies.base import Region, RowView
from sgl_kara.scheduler import spread
from sgl_kara.scheduler.pressure import DEFERRING
from sgl_kara.scheduler.state import KaraReqState

MAX_CATCH_UP_PASSES = 8
# trigger=pressure / headroom: a deferred backlog (several windows per request) is compressed
# while memory binds, at most this many windows per request in one event.
MAX_PRESSURE_PASSES = 64


@dataclass
class Job:
    """One request's part of an event (or of a spread step)."""

    index: int  # position in the running batch
    req: object
    state: KaraReqState
    region: Region
    planned: RowView | None = None  # the rows it was planned on

    @property
    def length(self) -> int:
        return adapter.kv_length(self.req)

    @property
    def row(self) -> int:
        return adapter.row_index(self.req)

    def view(self) -> RowView:
        s = self.state
        return RowView(s.protected, s.frontier, self.length, s.pos_offset, s)

    def as_planned(self) -> bool:
        """Are its rows (P, frontier, length, offset) still those it was planned on?"""
        p, now = self.planned, self.view()
        return p is None or (p.protected, p.frontier, p.length, p.pos_offset) == (
            now.protected,
            now.frontier,
            now.length,
            now.pos_offset,
        )

    def compressed(self) -> RowView:
        """The rows its commit leaves: the region kept to K, the rows after it moved down."""
        row, r = self.planned, self.region
        dropped = r.length - r.keep
        return dataclasses.replace(
            row,
            frontier=r.start + r.keep,
            length=row.length - dropped,
            pos_offset=row.pos_offset + dropped,
        )

    def fresh_slots(self, page_size: int) -> int:
        """Slots compacting this job allocates before it frees the old ones."""
        r = self.region
        return fresh_slots_needed(r.start, self.length, r.length, r.keep, page_size)


def protected_length(
    req, state: KaraReqState, length: int, page_size: int
) -> int | None:
    """P: the state's once fixed; else the length it is fixed at now -- the tree-owned prefix and
    the prompt, rounded up to a page -- once the row reached it and its prefill's result is
    processed (the radix tree may then have swapped the prompt's slots for its own: under the
    overlap scheduler the first decode step is planned before that); None until then."""
    if state.protected >= 0:
        return state.protected
    if not adapter.output_length(req):
        return None
    p = max(adapter.tree_prefix_length(req), len(adapter.prompt_ids(req)))
    if page_size > 1:
        p = -(-p // page_size) * page_size
    return p if length >= p else None


@dataclass
class Seen:
    """A running request an event may touch now, as this step's plan sees it: its row (the
    step's one snapshot of it), the tokens it has still to generate, and whether its protected
    prefix P is fixed by this step's plan."""

    index: int  # position in the running batch
    req: object
    state: KaraReqState
    row: RowView
    remaining: int
    fixes: bool

    def job(self, region: Region) -> Job:
        return Job(self.index, self.req, self.state, region, self.row)


def snapshot(reqs, state_of, page_size: int) -> list[Seen]:
    """The running requests (in batch order) an event may touch now: compression on for it, not
    finishing, its KV fully committed, more than one token to go, P known. Reads only."""
    out = []
    for i, req in enumerate(reqs):
        state = state_of(req)
        if not state.enabled or adapter.finishing(req) or not adapter.kv_settled(req):
            continue
        length = adapter.kv_length(req)
        remaining = adapter.max_new_tokens(req) - decoded_tokens(req, state)
        if remaining <= 1:
            continue  # about to finish: its slots are freed anyway
        p = protected_length(req, state, length, page_size)
        if p is None:
            continue
        fixes = state.protected < 0
        frontier = p if fixes else state.frontier
        row = RowView(p, frontier, length, state.pos_offset, state)
        out.append(Seen(i, req, state, row, remaining, fixes))
    return out


def decoded_tokens(req, state: KaraReqState) -> int:
    """The request's output tokens, counting the one this decode step feeds in: ``len(output_ids)``
    under SGLang's normal scheduler. Under its overlap scheduler the previous step's token is
    still in flight (not yet in ``output_ids``) when the next step is planned, so the count comes
    from the KV rows, which both schedulers have advanced alike by then: the rows held, plus the
    entries dropped, less the prompt, plus the token being fed."""
    return adapter.kv_length(req) + state.pos_offset - len(adapter.prompt_ids(req)) + 1


def due_at(policy, phase: str, server_step: int, req, state: KaraReqState) -> bool:
    """Is an event due for ``req`` at this decode step (``server_step``: the scheduler's)?"""
    return policy.schedule.due(
        server_step if phase == "server" else decoded_tokens(req, state)
    )


def overdue(tail: int, charge: int | None, interval: int) -> bool:
    """Would this tail, growing one row per step until the next due step ``interval`` steps
    away, exceed the ``charge`` admission made for it (None: no bound)?"""
    return charge is not None and tail + interval > charge


def choose(tails: list[int], charges: list, interval: int, max_seqs: int) -> list[int]:
    """Indices of the due requests one event compresses, longest tail first (stable): every
    overdue one, then the others while fewer than ``max_seqs`` are chosen."""
    order = sorted(range(len(tails)), key=lambda i: -tails[i])
    late = [i for i in order if overdue(tails[i], charges[i], interval)]
    rest = [i for i in order if not overdue(tails[i], charges[i], interval)]
    picked = set(late + rest[: max(0, max_seqs - len(late))])
    return [i for i in order if i in picked]


def plan_jobs(
    policy, seen: list[Seen], max_seqs: int, due=None, slack: int = 0
) -> list[Job]:
    """Jobs for the requests ``seen`` (this step's snapshot, in batch order) for which ``due(req,
    state)`` holds (None: all of them). A request not due costs one check: with
    ``--kara-phase request`` this runs at every decode step. ``slack``: rows admission charged
    beyond the policy's tail charge (a capped ``--kara-spread`` may delay an event by that
    much)."""
    cands = []
    for s in seen:
        if due is not None and not due(s.req, s.state):
            continue
        region = policy.region(s.row)
        if region is not None and policy.schedule.worth_compressing(s.row, s.remaining):
            charge = policy.schedule.tail_charge(s.row)
            limit = None if charge is None else charge + slack
            cands.append((s.row.length - s.row.frontier, limit, s.job(region)))
    picked = choose(
        [c[0] for c in cands],
        [c[1] for c in cands],
        policy.schedule.event_interval(),
        max_seqs,
    )
    return [cands[i][2] for i in picked]


def plan_chunks(
    policy,
    seen: list[Seen],
    cap: int,
    now_of,
    least: int = spread.MIN_CHUNK,
    in_flight: int = 0,
) -> tuple[list[tuple[Job, int]], list[tuple[KaraReqState, spread.ScoringJob]]]:
    """This step's spread scoring: ``[(Job, n)]``, the next ``n`` queries of each request's
    upcoming window, and the spread jobs it opens ``[(state, ScoringJob)]`` (one is opened on
    the request's row the first step its window's keys are all decoded; applied by ``apply``
    before the parts are scored). ``now_of(req, state)``: the count the policy's due steps are
    in (the request's own decoded tokens, or the scheduler's step under ``--kara-phase
    server``); ``least``: the part size (spread.part_size); ``in_flight``: a row's newest rows
    a forward in flight still writes (SGLang's overlap scheduler: 1), never scored ahead."""
    out, opened = [], []
    for s in seen:
        up = policy.schedule.upcoming(s.row)
        if up is None:
            continue
        region, to_region = up
        job = s.state.scoring
        now = now_of(s.req, s.state)
        if job is None or not job.covers(region):
            ahead = dataclasses.replace(s.row, length=s.row.length + to_region)
            if not policy.schedule.worth_compressing(ahead, s.remaining - to_region):
                continue  # it finishes before this window would be compressed
            steps = (
                spread.deadline(policy, now, to_region, region.query_len, cap) - now + 1
            )
            stride = spread.stride_for(region.query_len, steps, cap, least)
            start = now + spread.phase(adapter.prompt_ids(s.req), stride)
            job = spread.ScoringJob(region, start=start, stride=stride)
            opened.append((s.state, job))
        if job.remaining <= 0:
            continue
        steps_left = spread.deadline(policy, now, to_region, job.remaining, cap) - now
        if steps_left > 0 and (now < job.start or (now - job.start) % job.stride):
            continue  # not one of its scoring steps
        n = spread.chunk(
            job.remaining,
            spread.decoded(region, s.row.length - in_flight, job.done),
            steps_left // job.stride,
            cap,
            least if not cap else 1,
        )
        if n:
            out.append((s.job(region), n))
    return out, opened


@dataclass
class StepPlan:
    """A decode step's compression work, decided at once from the step's snapshot: the
    protected prefixes it fixes and the spread jobs it opens (written first, ``apply``), the
    spread parts it scores, then the event's passes (the due jobs, then the catch-up's)."""

    fixed: list[Seen] = field(default_factory=list)
    opened: list = field(default_factory=list)  # [(KaraReqState, ScoringJob)]
    chunks: list = field(default_factory=list)  # [(Job, n)]
    passes: list = field(default_factory=list)  # [[Job]]


def apply(plan: StepPlan, on_protected=None) -> None:
    """The plan's openings, written before any of its work runs: each P fixed now (the frontier
    at it; ``on_protected(req, state)`` told, the step observers'), each spread job opened."""
    for s in plan.fixed:
        s.state.fix_protected(s.row.protected)
        if on_protected is not None:
            on_protected(s.req, s.state)
    for state, job in plan.opened:
        state.open_scoring(job)


class Planner:
    """Decides a decode step's scoring (``chunks``, scored first) and event (``jobs``) from the
    running requests and their state.

    ``cfg``: phase, spread, spread_max, max_seqs; ``parts``: the scheduler's page size, device
    and schedule (_sglang.SchedulerParts); ``on_protected(req, state)``: told when a request's
    protected prefix is fixed (the step observers'). Derived: ``spreading`` (spread scoring on
    for this policy), ``slack`` (rows admission charges for a capped spread), ``part`` (the
    spread part size), ``in_flight`` (a running request's newest rows a forward in flight
    writes while the step is planned: 1 under SGLang's overlap scheduler), ``passes`` (the
    event's passes at most, catch-up included)."""

    def __init__(self, policy, cfg, parts, on_protected=None):
        self.policy = policy
        self.phase, self.cap, self.max_seqs = cfg.phase, cfg.spread_max, cfg.max_seqs
        self.page_size = parts.page_size
        self.spreading = spread.spreads(policy, cfg.spread)
        self.slack = spread.slack(policy, cfg.spread_max) if self.spreading else 0
        self.part = spread.part_size(parts.req_to_token.device.type)
        self.in_flight = 1 if parts.overlap else 0
        self.on_protected = on_protected
        deferring = cfg.trigger in DEFERRING
        self.passes = MAX_PRESSURE_PASSES if deferring else MAX_CATCH_UP_PASSES

    def now(self, step: int):
        def now_of(req, state) -> int:
            return step if self.phase == "server" else decoded_tokens(req, state)

        return now_of

    def plan(self, reqs, state_of, step: int) -> StepPlan:
        """This step's plan from one snapshot of the running requests; writes nothing."""
        seen = snapshot(reqs, state_of, self.page_size)
        plan = StepPlan(fixed=[s for s in seen if s.fixes])
        if self.spreading:
            plan.chunks, plan.opened = plan_chunks(
                self.policy, seen, self.cap, self.now(step), self.part, self.in_flight
            )
        jobs = self._ready(self._due(seen, step), plan, seen)
        plan.passes = self._catch_up(jobs, seen, step) if jobs else []
        return plan

    def _due(self, seen: list[Seen], step: int) -> list[Job]:
        """The jobs of the requests due at this step (before the spread rule)."""
        if self.phase == "server" and not self.policy.schedule.due(step):
            return []

        def due(req, state) -> bool:
            return due_at(self.policy, self.phase, step, req, state)

        return plan_jobs(self.policy, seen, self.max_seqs, due=due, slack=self.slack)

    def _ready(self, jobs: list[Job], plan: StepPlan, seen: list[Seen]) -> list[Job]:
        """Due jobs an event takes now: a spread window whose scoring this step's parts leave
        unfinished waits for a later due step (its scores then complete: spread.deadline),
        unless its tail would outgrow what admission charged it."""
        if not self.spreading:
            return jobs
        opened = {id(state): job for state, job in plan.opened}
        parts = {id(j.state): n for j, n in plan.chunks}
        rows = {id(s.state): s.row for s in seen}
        out = []
        for j in jobs:
            key = id(j.state)
            s = opened.get(key, j.state.scoring)
            if (
                s is not None
                and s.covers(j.region)
                and s.remaining - parts.get(key, 0) > 0
            ):
                row = rows[key]
                charge = self.policy.schedule.tail_charge(row)
                limit = None if charge is None else charge + self.slack
                tail = row.length - row.frontier
                if not overdue(tail, limit, self.policy.schedule.event_interval()):
                    continue
            out.append(j)
        return out

    def _catch_up(
        self, jobs: list[Job], seen: list[Seen], step: int
    ) -> list[list[Job]]:
        """``jobs``, then pass by pass those of its requests still due on the rows the previous
        pass leaves them (the others' rows as the snapshot has them)."""
        passes = [jobs]
        while len(passes) < self.passes:
            after = {id(j.req): j.compressed() for j in passes[-1]}
            seen = [
                dataclasses.replace(s, row=after[id(s.req)], fixes=False)
                if id(s.req) in after
                else s
                for s in seen
            ]
            again = [j for j in self._due(seen, step) if id(j.req) in after]
            if not again:
                break
            passes.append(again)
        return passes
