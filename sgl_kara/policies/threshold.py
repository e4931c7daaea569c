"""Threshold-triggered policies (the paper's baselines): compress a request's generated KV back to
a budget whenever it exceeds a threshold.

    rows:  [ P (protected) | generated ............................ | last w ]
                             region [P, L - w): keep N - w of it       always kept
    due when L - P > C_max; the request then holds N generated entries (C_max - N fewer).

``custom_params.kara.budget`` (budget matching in the quality benchmark) sets N per request; the
threshold keeps its configured gap C_max - N. Subclasses implement ``score`` (and may override
``select``) and declare ``Options`` deriving from ``ThresholdOptions``.

Matched to Kara (``custom_params.kara.match_kara = {window, buffer, retention, period, recent}``):
instead of a budget and a threshold, the request follows Kara's generated KV at every decode step
(policies/trajectory.py): whenever its generated rows exceed what Kara with those settings holds
after step s's event, it is compressed down to exactly that (rows [P, L - w) keep ``target - w``).
Its generated KV then equals Kara's at every step of an answer of the same length -- mean, peak
and final alike -- and its events fall on Kara's event steps; only which entries are kept differs.
A step Kara leaves alone near the request's max_new_tokens the baseline leaves alone too
(``ThresholdSchedule.worth_compressing``). Exact while ``target > w`` (Kara keeps at least U + K
rows after an event, so U + K > w suffices) and the page size is 1 (trajectory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import trajectory
from .base import Policy, Region, RowView, need, request_option
from .schedule import Schedule


@dataclass(frozen=True)
class ThresholdOptions:
    threshold: int = field(
        default=1280,
        metadata={"help": "C_max: generated KV entries that trigger compression"},
    )
    budget: int = field(default=1024, metadata={"help": "N: generated KV entries kept"})
    window: int = field(
        default=32,
        metadata={
            "help": "w: most recent entries always kept (and observation queries)"
        },
    )

    def __post_init__(self):
        need(
            1 <= self.window <= 65536,
            "window",
            "must be an integer in [1, 65536]",
            self.window,
        )
        need(
            self.window < self.budget,
            "budget",
            f"must be > window={self.window}",
            self.budget,
        )
        need(
            self.budget < self.threshold <= 10_000_000,
            "threshold",
            f"must be in (budget={self.budget}, 10000000]",
            self.threshold,
        )


def matched(state) -> trajectory.Trajectory | None:
    """Kara's trajectory this request follows (unbounded), or None (budget and threshold)."""
    spec = request_option(state, "match_kara")
    return None if spec is None else trajectory.trajectory(trajectory.schedule_of(spec))


def step_of(row: RowView) -> int:
    """The decode step a row is at: its logical generated rows + 1 (page size 1: P is the
    prompt)."""
    return row.length - row.protected + row.pos_offset + 1


def target(row: RowView) -> int | None:
    """Matched: Kara's generated rows after this step's event; None otherwise."""
    traj = matched(row.state)
    return None if traj is None else traj.after(step_of(row))


def budget(options, state) -> tuple[int, int]:
    """(N, C_max) for this request."""
    n = request_option(state, "budget")
    n = options.budget if n is None else n
    return n, n + (options.threshold - options.budget)


class ThresholdSchedule(Schedule):
    """Due at every step; a request holds at most C_max + 1 generated entries (matched: Kara's
    most rows)."""

    def tail_charge(self, row: RowView) -> int:
        """``footprint`` charged C_max + 1 generated entries: rows [P, L), of which [P, f) are
        the entries kept by earlier compressions. Matched: Kara's rows at this step, so a due
        request is always overdue (never left out of an event by max_seqs)."""
        t = target(row)
        if t is not None:
            return t - (row.frontier - row.protected)
        _, threshold = budget(self.options, row.state)
        return threshold + 1 - (row.frontier - row.protected)

    def worth_compressing(self, row: RowView, remaining: int) -> bool:
        """Matched: only where Kara compresses a request of this max_new_tokens (it leaves one
        alone whose tail lasts it to the end), so the two hold the same rows to the last step."""
        if remaining <= 1:
            return False
        spec = request_option(row.state, "match_kara")
        if spec is None:
            return True
        step = step_of(row)
        limited = trajectory.trajectory(trajectory.schedule_of(spec), step + remaining)
        return limited.after(step) < row.length - row.protected

    def query_capacity(self) -> int:
        # Events are checked every step, so the last w queries plus the one being written.
        return self.options.window + 1 if self.policy.needs_queries else 0

    def footprint(self, remaining: int, state) -> int:
        if remaining <= 0:
            return remaining
        traj = matched(state)
        if traj is not None:  # Kara's most rows over the answer, and the last token's
            return min(remaining, traj.peak(remaining + 1) + 1)
        _, threshold = budget(self.options, state)
        return min(remaining, threshold + 1)

    def growth(self, remaining: int, row: RowView) -> int:
        """A running request holds at most C_max + 1 generated entries (matched: Kara's most
        rows up to its last step); those it holds already (rows [P, L)) count toward them."""
        if remaining <= 0:
            return remaining
        held = row.length - row.protected if row.protected >= 0 else 0
        traj = matched(row.state)
        if traj is not None:
            most = (
                traj.peak(step_of(row) + remaining) + 1
                if row.protected >= 0
                else (traj.peak(remaining + 1) + 1)
            )
            return min(remaining, max(0, most - held))
        _, threshold = budget(self.options, row.state)
        return min(remaining, max(0, threshold + 1 - held))


class ThresholdPolicy(Policy):
    Schedule = ThresholdSchedule
    request_options = ("budget", "match_kara")

    def region(self, row: RowView) -> Region | None:
        w = self.options.window
        matched_rows = target(row)
        if matched_rows is not None:
            keep_to = threshold = matched_rows
        else:
            keep_to, threshold = budget(self.options, row.state)
        if row.length - row.protected <= threshold:
            return None
        m = row.length - w - row.protected
        keep = max(1, keep_to - w)
        if m <= keep:
            return None
        q_len = w if self.needs_queries else 0
        return Region(row.protected, m, keep, row.length - w, q_len)
