"""Which running requests an event compresses, and where: the policy's regions, longest
uncompressed tail first, at most ``max_seqs`` of them.

A request takes part once its row has reached its protected length P (fixed here, at the first
check after the prefill: the tree-owned prefix and the prompt, rounded up to a page), when it is
not finishing anyway (``policy.worth_compressing``: Kara leaves a request whose uncompressed
tail stays within W + period until its max_new_tokens), and when its KV is fully committed.
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
        return fresh_slots_needed(r.start, int(self.req.kv.kv_committed_len), r.length, r.keep, page_size)


def fix_protected(req, state: KaraReqState, length: int, page_size: int) -> bool:
    """Fix P once the row reaches it; False while the row is still shorter than P."""
    if state.protected >= 0:
        return True
    p = max(int(req.kv.cache_protected_len), len(req.origin_input_ids))
    if page_size > 1:
        p = -(-p // page_size) * page_size
    if length < p:
        return False
    state.protected = p
    state.frontier = p
    return True


def plan_jobs(policy, reqs, state_of, page_size: int, max_seqs: int, on_protected=None) -> list[Job]:
    """Jobs for the requests ``reqs`` (the running batch's, in order)."""
    cands = []
    for i, req in enumerate(reqs):
        state = state_of(req)
        if not state.enabled or req.finished() or getattr(req, "to_finish", None) is not None:
            continue
        length = int(req.kv.kv_committed_len)
        if length != int(req.kv.kv_allocated_len):
            continue
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
        if remaining <= 1:
            continue  # about to finish: its slots are freed anyway
        fixed_now = state.protected < 0
        if not fix_protected(req, state, length, page_size):
            continue
        if fixed_now and on_protected is not None:
            on_protected(req, state)
        row = RowView(state.protected, state.frontier, length, state.pos_offset, state)
        region = policy.region(row)
        if region is not None and policy.worth_compressing(row, remaining):
            cands.append((length - state.frontier, Job(i, req, state, region)))
    cands.sort(key=lambda c: -c[0])  # longest uncompressed tail first (stable)
    return [job for _, job in cands[:max_seqs]]
