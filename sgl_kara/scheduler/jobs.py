"""Which running requests an event compresses, and where: the policy's regions, longest
uncompressed tail first, at most ``max_seqs`` of them -- and more when more are overdue
(``choose``): a due request whose tail, left to the next due step, would outgrow what admission
charged it (``policy.tail_charge``) is always in the event, so events keep up with any number of
running requests (at max_seqs = 30 and one event per period = 128 steps, the paper's limit holds
up to ~30 x (W - U) / period = 112 running requests at W = 512, U = 32).

Which requests are due (``due_at``): with ``--kara-phase request`` (the default) a request is due when
its own generated-token count is a due step of the policy, so the steps at which it is compressed,
and therefore its answer, depend on its own progress only (two identical greedy requests answer
alike whatever else runs and whenever they arrived); with ``server`` every request is due at the
scheduler's due steps (the paper's schedule: all requests in step, fewer and larger events).

A request takes part once its row has reached its protected length P (fixed here, at the first
check after the prefill: the tree-owned prefix and the prompt, rounded up to a page), when it is
not finishing anyway (``policy.worth_compressing``: Kara leaves a request whose uncompressed
tail stays within W + period until its max_new_tokens), and when its KV is fully committed.
A request's own count (``decoded_tokens``) is the same under SGLang's normal and overlap
schedulers, so it is compressed at the same steps under both.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_kara.mem_cache.compaction import fresh_slots_needed
from sgl_kara.policies.base import Region, RowView
from sgl_kara.scheduler.state import KaraReqState


@dataclass
class Job:
    """One request's part of an event."""

    index: int  # position in the running batch
    req: object
    state: KaraReqState
    region: Region

    def fresh_slots(self, page_size: int) -> int:
        """Slots compacting this job allocates before it frees the old ones."""
        r = self.region
        return fresh_slots_needed(
            r.start, int(self.req.kv.kv_committed_len), r.length, r.keep, page_size
        )


def fix_protected(req, state: KaraReqState, length: int, page_size: int) -> bool:
    """Fix P once the row reaches it and its prefill's result is processed (the radix tree may
    then have swapped the prompt's slots for its own: under the overlap scheduler the first
    decode step is planned before that); False until then."""
    if state.protected >= 0:
        return True
    if not req.output_ids:
        return False
    p = max(int(req.kv.cache_protected_len), len(req.origin_input_ids))
    if page_size > 1:
        p = -(-p // page_size) * page_size
    if length < p:
        return False
    state.protected = p
    state.frontier = p
    return True


def decoded_tokens(req, state: KaraReqState) -> int:
    """The request's output tokens, counting the one this decode step feeds in: ``len(output_ids)``
    under SGLang's normal scheduler. Under its overlap scheduler the previous step's token is still
    in flight (not yet in ``output_ids``) when the next step is planned, so the count comes from
    the KV rows, which both schedulers have advanced alike by then: the rows held, plus the
    entries dropped, less the prompt, plus the token being fed."""
    return (
        int(req.kv.kv_committed_len) + state.pos_offset - len(req.origin_input_ids) + 1
    )


def due_at(policy, phase: str, server_step: int, req) -> bool:
    """Is an event due for ``req`` at this decode step (``server_step``: the scheduler's count)?"""
    return policy.due(
        server_step if phase == "server" else decoded_tokens(req, req.kara)
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


def eligible(
    req, state: KaraReqState, page_size: int, on_protected=None
) -> tuple[RowView, int] | None:
    """(its row as a policy sees it, tokens still to generate) of a request an event may touch now:
    compression on for it, not finishing, its KV fully committed, P fixed (here, at the first check
    once the row reaches it). None otherwise."""
    if (
        not state.enabled
        or req.finished()
        or getattr(req, "to_finish", None) is not None
    ):
        return None
    length = int(req.kv.kv_committed_len)
    if length != int(req.kv.kv_allocated_len):
        return None
    remaining = req.sampling_params.max_new_tokens - decoded_tokens(req, state)
    if remaining <= 1:
        return None  # about to finish: its slots are freed anyway
    fixed_now = state.protected < 0
    if not fix_protected(req, state, length, page_size):
        return None
    if fixed_now and on_protected is not None:
        on_protected(req, state)
    return RowView(
        state.protected, state.frontier, length, state.pos_offset, state
    ), remaining


def plan_jobs(
    policy,
    reqs,
    state_of,
    page_size: int,
    max_seqs: int,
    on_protected=None,
    due=None,
    slack: int = 0,
) -> list[Job]:
    """Jobs for the requests ``reqs`` (the running batch's, in order) for which ``due(req)`` holds
    (None: all of them). A request not due costs one check: with ``--kara-phase request`` this runs
    at every decode step. ``slack``: rows admission charged beyond the policy's tail charge (a
    capped ``--kara-spread`` may delay an event by that much)."""
    cands = []
    for i, req in enumerate(reqs):
        if due is not None and not due(req):
            continue
        state = state_of(req)
        ok = eligible(req, state, page_size, on_protected)
        if ok is None:
            continue
        row, remaining = ok
        region = policy.region(row)
        if region is not None and policy.worth_compressing(row, remaining):
            charge = policy.tail_charge(row)
            cands.append(
                (
                    row.length - state.frontier,
                    None if charge is None else charge + slack,
                    Job(i, req, state, region),
                )
            )
    picked = choose(
        [c[0] for c in cands], [c[1] for c in cands], policy.event_interval(), max_seqs
    )
    return [cands[i][2] for i in picked]
