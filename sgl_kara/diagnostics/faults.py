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

Both are step observers (scheduler/observers.py). ``Faults`` raises at an event's
``score`` and ``commit`` stages. For ``recompute`` it wraps the scorer's recompute
forward once, when it is registered: a forward over a target request gets a scoring pass
whose middle layer raises. That layer is reached inside the model, where a real scoring
failure is kept on the pass until the forward has left the model (forward.py). Neither
the scorer nor the forward hooks know about faults. ``Divergence`` edits an event's
planned jobs.
"""

from __future__ import annotations

import logging

from sgl_kara import _sglang as adapter
from sgl_kara import env
from sgl_kara.scheduler.observers import StepObserver

logger = logging.getLogger(__name__)

STAGES = ("score", "recompute", "commit")


class InjectedFault(RuntimeError):
    pass


class Faults(StepObserver):
    """``KARA_INJECT_FAULT_*``: the chunks and recompute forwards of requests whose rid
    starts with ``prefix`` fail at ``stage`` (on TP rank ``rank`` only, where given)."""

    def __init__(self, prefix: str, stage: str, rank: int | None, tp_rank: int):
        if stage not in STAGES:
            raise ValueError(
                f"KARA_INJECT_FAULT_AT must be one of {', '.join(STAGES)} (got {stage!r})"
            )
        self.prefix, self.at = prefix, stage  # the stage it fires at
        self.armed = bool(prefix) and (rank is None or rank == tp_rank)
        self.tp_rank = tp_rank

    @classmethod
    def from_env(cls, tp_rank: int, scorer=None) -> Faults | None:
        """The faults asked for (None: none); ``scorer``: the runtime's, whose recompute
        forwards a ``recompute`` fault fails in (None: none fails there)."""
        prefix = env.inject_fault_rid_prefix()
        if not prefix:
            return None
        faults = cls(
            prefix, env.inject_fault_stage(), env.inject_fault_tp_rank(), tp_rank
        )
        if scorer is not None and faults.armed and faults.at == "recompute":
            faults.fail_recompute_of(scorer)
        return faults

    def hits(self, stage: str, reqs) -> bool:
        """Is one of ``reqs`` a target at ``stage`` here?"""
        return (
            self.armed
            and stage == self.at
            and any(str(adapter.rid(r)).startswith(self.prefix) for r in reqs)
        )

    def error(self, stage: str) -> InjectedFault:
        return InjectedFault(
            f"injected fault at {stage} on tensor-parallel rank {self.tp_rank} "
            "(KARA_INJECT_FAULT_RID_PREFIX)"
        )

    def stage(self, name: str, jobs) -> None:
        """An event's chunk at stage ``name``: raise there if it holds a target."""
        if self.hits(name, [j.req for j in jobs]):
            raise self.error(name)

    def fail_recompute_of(self, scorer) -> None:
        """Wrap ``scorer``'s recompute forward (``Scorer._recompute``): a forward over a
        target request scores with a pass that fails at its middle layer."""
        recompute = scorer._recompute

        def recompute_with_fault(jobs, rows, scoring, q_lo, n):
            if self.hits("recompute", [j.req for j in jobs]):
                _fail_at_middle_layer(scoring, self.error("recompute"))
            return recompute(jobs, rows, scoring, q_lo, n)

        scorer._recompute = recompute_with_fault


def _fail_at_middle_layer(scoring, error: Exception) -> None:
    """This scoring pass (one recompute forward's) raises ``error`` when the forward
    reaches its middle layer."""
    score_layer = scoring.score_layer

    def failing(layer_id, q):
        if layer_id == scoring.last_layer // 2:
            raise error
        return score_layer(layer_id, q)

    scoring.score_layer = failing


class Divergence(StepObserver):
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
