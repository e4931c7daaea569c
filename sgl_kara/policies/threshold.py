"""Threshold-triggered policies (the paper's baselines): compress a request's generated KV back to
a budget whenever it exceeds a threshold.

    rows:  [ P (protected) | generated ............................ | last w ]
                             region [P, L - w): keep N - w of it       always kept
    due when L - P > C_max; the request then holds N generated entries (C_max - N fewer).

``custom_params.kara.budget`` (budget matching in the quality benchmark) sets N per request; the
threshold keeps its configured gap C_max - N. Subclasses implement ``score`` (and may override
``select``) and declare ``Options`` deriving from ``ThresholdOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import Policy, Region, RowView, need


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


class ThresholdPolicy(Policy):
    request_options = ("budget",)

    def _budget(self, state) -> tuple[int, int]:
        """(N, C_max) for this request."""
        o = self.options
        budget = (
            state.budget if state is not None and state.budget is not None else o.budget
        )
        return budget, budget + (o.threshold - o.budget)

    def region(self, row: RowView) -> Region | None:
        w = self.options.window
        budget, threshold = self._budget(row.state)
        if row.length - row.protected <= threshold:
            return None
        m = row.length - w - row.protected
        keep = max(1, budget - w)
        if m <= keep:
            return None
        q_len = w if self.needs_queries else 0
        return Region(row.protected, m, keep, row.length - w, q_len)

    def tail_charge(self, row: RowView) -> int:
        """``footprint`` charged C_max + 1 generated entries: rows [P, L), of which [P, f) are
        the entries kept by earlier compressions."""
        _, threshold = self._budget(row.state)
        return threshold + 1 - (row.frontier - row.protected)

    def query_capacity(self) -> int:
        # Events are checked every step, so the last w queries plus the one being written.
        return self.options.window + 1 if self.needs_queries else 0

    def footprint(self, remaining: int, state) -> int:
        if remaining <= 0:
            return remaining
        _, threshold = self._budget(state)
        return min(remaining, threshold + 1)

    def growth(self, remaining: int, row: RowView) -> int:
        """A running request holds at most C_max + 1 generated entries; those it holds already
        (rows [P, L)) count toward them."""
        if remaining <= 0:
            return remaining
        _, threshold = self._budget(row.state)
        held = row.length - row.protected if row.protected >= 0 else 0
        return min(remaining, max(0, threshold + 1 - held))
