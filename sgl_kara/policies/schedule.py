"""The schedule of a policy: when its events fall and how much KV a request holds between them.

A policy (base.py) decides *where* and *what*; its schedule decides *when* and *how much*, and
every caller outside the policy (planning, admission, pressure, spread scoring) asks the schedule:

    when      ``due(step)``            is an event due at this decode step? (a request's own
                                       generated-token count, or the scheduler's step)
              ``next_due(step)``       the first due step at or after ``step``
              ``event_interval()``     at most how many steps apart due steps are
              ``upcoming(row)``        the next region before it is due (spread scoring)
              ``worth_compressing(row, remaining)``  leave a request that finishes soon alone
    how much  ``footprint(remaining, state)``  tokens a request will hold of ``remaining`` more
                                       (admission of a new request by compressed footprint)
              ``growth(remaining, row)``  tokens a running request's KV may still grow by
              ``tail_charge(row)``     most uncompressed rows ``footprint`` charged a request
              ``query_capacity()``     queries per request a capture ring keeps

This class is the default (an event may fall at every step, no bound on the tail, admission
charges the whole answer); a policy that times its events or bounds its footprint differently
subclasses it in its own file and names it as its ``Schedule``. The base policy builds one per
policy (``policy.schedule``); it reads the policy's ``options`` and ``region``.

Imports nothing from SGLang, config, mem_cache or scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Policy, Region, RowView


class Schedule:
    def __init__(self, policy: Policy):
        self.policy = policy
        self.options = policy.options

    # -- when ---------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return True

    def next_due(self, step: int) -> int:
        """The first due step at or after ``step`` (``due`` recurs at most ``event_interval()``
        steps apart)."""
        for s in range(step, step + self.event_interval() + 1):
            if self.due(s):
                return s
        raise RuntimeError(
            f"{self.policy.name}: no due step within event_interval() of {step}"
        )

    def event_interval(self) -> int:
        """Most decode steps between two due steps (``--kara-trigger pressure`` looks this far
        ahead: memory the running requests need before the next chance to compress)."""
        return 1

    def upcoming(self, row: RowView) -> tuple[Region, int] | None:
        """The region the next event of this request will compress, as soon as its keys are final
        (it may not be due yet), and the decode steps until ``region`` names it (0: now); None
        while not known. The runtime scores an additive policy's upcoming region early, its
        queries as they are decoded. Default: known only once due."""
        r = self.policy.region(row)
        return None if r is None else (r, 0)

    def worth_compressing(self, row: RowView, remaining: int) -> bool:
        """False: leave this request's due region alone, it finishes within ``remaining`` more
        tokens before the freed slots matter (still within what admission charged it)."""
        return remaining > 1

    # -- how much -----------------------------------------------------------------------------
    def footprint(self, remaining: int, state) -> int:
        """Tokens of ``remaining`` future ones a request will hold (admission)."""
        return remaining

    def growth(self, remaining: int, row: RowView) -> int:
        """Most tokens by which a running request's KV (``row``) may still grow while it
        generates ``remaining`` more: its footprint less what it already holds toward it.
        Default: the footprint (nothing held counts)."""
        return self.footprint(remaining, row.state)

    def tail_charge(self, row: RowView) -> int | None:
        """Most uncompressed rows (``row.length - row.frontier``) ``footprint`` charged this
        request; an event compresses every due request that would outgrow it before the next due
        step, beyond ``--kara-max-seqs`` if need be (None: no bound, max_seqs alone limits)."""
        return None

    def query_capacity(self) -> int:
        """Queries per request a capture ring must keep for this policy (0: none)."""
        return 0
