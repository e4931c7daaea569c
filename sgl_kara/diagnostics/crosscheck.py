"""``KARA_CROSSCHECK_QUERIES=1``: on a request's first window, scores from the capture
ring's queries are compared with scores from a recompute forward of the same window (the
prefix is exact then, so both sources must agree). The largest relative difference a
request saw is reported in its ``meta_info["kara"]["query_crosscheck_max_rel_err"]``.

The scorer does not know about this check. When the observer is registered it wraps the
scorer's ring scoring (``Scorer._captured_scores``) once, so that each batch of captured
scores is also recomputed and compared. The comparison reads scores back on the host,
which only a diagnostic may do.
"""

from __future__ import annotations

from sgl_kara.scheduler.observers import StepObserver
from sgl_kara.scheduler.state import SideTable


class QueryCrosscheck(StepObserver):
    def __init__(self, scorer):
        self.scorer = scorer
        self.errors = SideTable()  # per request: the largest relative difference seen
        captured_scores = scorer._captured_scores

        def crosschecked(jobs, rows, region_slots, q_starts, n):
            captured = captured_scores(jobs, rows, region_slots, q_starts, n)
            self.compare(jobs, rows, region_slots, captured, q_starts, n)
            return captured

        scorer._captured_scores = crosschecked

    def compare(self, jobs, rows, region_slots, captured, q_starts, n) -> None:
        """The jobs on their first window: the same queries recomputed, and the scores
        compared."""
        first = [i for i, j in enumerate(jobs) if j.state.compressions == 0]
        if not first:
            return
        scorer = self.scorer
        sub = [jobs[i] for i in first]
        idx = scorer.staging.to_device(first)
        q_lo = [q_starts[i] - jobs[i].state.pos_offset for i in first]
        recomputed = scorer._recompute_scores(
            sub, rows[idx], region_slots[idx], q_lo, n
        )
        for k, i in enumerate(first):
            a, b = captured[i], recomputed[k]
            err = float(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
            prev = self.errors.get(jobs[i].state)
            self.errors.set(jobs[i].state, err if prev is None else max(prev, err))

    def meta(self, state, meta: dict) -> None:
        err = self.errors.get(state)
        if err is not None:
            meta["query_crosscheck_max_rel_err"] = err
