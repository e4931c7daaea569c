"""Diagnostics and injected faults: what a Kara runtime runs only when an environment
variable asks for it (tests, and a user chasing a problem), kept out of the production
modules. Each is a step observer (sgl_kara/scheduler/observers.py), and
``observers_from_env`` is the only place that registers them: a server that asks for
none has none and keeps none of their state.

    KARA_CHECK_SYNC            sync_observer.SyncObserver: steps under the sync check
    KARA_INJECT_FAULT_*        faults.Faults: an event fails at a chosen stage for
                               chosen requests
    KARA_INJECT_TP_DIVERGENCE  faults.Divergence: one tensor-parallel rank's plan
                               made to differ
    KARA_CHECK_INTEGRITY       row_integrity.RowIntegrity: prefixes, slots, ring and
                               offsets checked after every event pass
    KARA_CROSSCHECK_QUERIES    crosscheck.QueryCrosscheck: captured and recomputed
                               scores compared on first windows

Each observer's module is imported where it is registered. sync_check.py, the checker
itself, imports only torch (bench/gpu_check.py loads it alone).
"""

from __future__ import annotations

from sgl_kara import env


def observers_from_env(runtime) -> list:
    """The step observers the environment asks for on ``runtime`` (an empty list when it
    asks for none), in the order they see each hook."""
    parts = runtime.parts
    observers = []
    if env.check_sync():
        from sgl_kara.diagnostics.sync_observer import SyncObserver

        observers.append(SyncObserver())
    observers += fault_observers(parts.tp_rank, parts.tp_size, runtime.scorer)
    if env.check_integrity():
        from sgl_kara.diagnostics.row_integrity import RowIntegrity

        observers.append(
            RowIntegrity(parts, runtime.table, runtime.ring, runtime.forward)
        )
    if env.crosscheck_queries():
        from sgl_kara.diagnostics.crosscheck import QueryCrosscheck

        observers.append(QueryCrosscheck(runtime.scorer))
    return observers


def fault_observers(tp_rank: int = 0, tp_size: int = 1, scorer=None) -> list:
    """The injected faults and plan divergence the environment asks for on this rank.
    ``scorer``: the one whose recompute forwards a ``recompute`` fault fails in (None:
    only an event's own stages fail)."""
    from sgl_kara.diagnostics.faults import Divergence, Faults

    found = [
        Faults.from_env(tp_rank, scorer),
        Divergence.from_env(tp_rank, tp_size),
    ]
    return [o for o in found if o is not None]
