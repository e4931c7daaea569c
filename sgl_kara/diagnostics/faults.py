"""Injected faults and divergences (tests): each makes one request's compression fail, or one
tensor-parallel rank's plan differ, at a chosen point, so that the tests can see the failure
contained (the request aborted alone, the event undone on every rank, the server stopped with the
rank named) rather than assume it.

    KARA_INJECT_FAULT_RID_PREFIX   requests whose rid starts with it fail
    KARA_INJECT_FAULT_AT           where: ``score`` (before its window is scored), ``recompute``
                                   (inside the recompute forward, at its middle layer's
                                   attention), ``commit`` (after its kept K/V are copied into
                                   fresh slots, just before the rows are rewritten)
    KARA_INJECT_FAULT_TP_RANK      on this tensor-parallel rank only (default: every rank)
    KARA_INJECT_TP_DIVERGENCE      ``rank`` or ``rank:prefix``: with KARA_CHECK_TP_PLAN, that rank
                                   drops a job (that request's) from the first event that holds it
"""

from __future__ import annotations

import logging

from sgl_kara import _sglang as adapter
from sgl_kara import env

logger = logging.getLogger(__name__)

STAGES = ("score", "recompute", "commit")


class InjectedFault(RuntimeError):
    pass


class Faults:
    def __init__(self, prefix: str, stage: str, rank: int | None, tp_rank: int):
        if stage not in STAGES:
            raise ValueError(
                f"KARA_INJECT_FAULT_AT must be one of {', '.join(STAGES)} (got {stage!r})"
            )
        self.prefix, self.stage = prefix, stage
        self.armed = bool(prefix) and (rank is None or rank == tp_rank)
        self.tp_rank = tp_rank

    @classmethod
    def from_env(cls, tp_rank: int) -> Faults | None:
        prefix = env.inject_fault_rid_prefix()
        if not prefix:
            return None
        return cls(
            prefix, env.inject_fault_stage(), env.inject_fault_tp_rank(), tp_rank
        )

    def check(self, stage: str, reqs) -> None:
        """Raise at ``stage`` if one of ``reqs`` is a target here."""
        if (
            self.armed
            and stage == self.stage
            and any(str(adapter.rid(r)).startswith(self.prefix) for r in reqs)
        ):
            raise InjectedFault(
                f"injected fault at {stage} on tensor-parallel rank {self.tp_rank} "
                "(KARA_INJECT_FAULT_RID_PREFIX)"
            )


class Divergence:
    """``KARA_INJECT_TP_DIVERGENCE``: this rank drops one job from its event plan, once."""

    def __init__(self, prefix: str, rank: int):
        self.prefix, self.rank = prefix, rank

    @classmethod
    def from_env(cls, tp_rank: int, tp_size: int) -> Divergence | None:
        armed, prefix = env.inject_tp_divergence()
        if tp_size <= 1 or armed != tp_rank or not env.check_tp_plan():
            return None
        logger.info("sgl_kara: a plan divergence is injected on TP rank %d", tp_rank)
        return cls(prefix, tp_rank)

    def planned(self, jobs: list) -> list:
        if self.prefix is None:
            return jobs
        drop = next(
            (j for j in jobs if str(adapter.rid(j.req)).startswith(self.prefix)), None
        )
        if drop is None:
            return jobs
        self.prefix = None
        logger.warning(
            "sgl_kara: KARA_INJECT_TP_DIVERGENCE: TP rank %d drops request %s from its "
            "event plan",
            self.rank,
            adapter.rid(drop.req),
        )
        return [j for j in jobs if j is not drop]
