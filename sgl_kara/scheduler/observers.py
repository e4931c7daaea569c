"""Step observers: what a diagnostic sees of a Kara decode step, and where it may act.

A diagnostic that an environment variable asks for is a ``StepObserver``
(sgl_kara/diagnostics registers them). The runtime keeps its observers in one
``Observers`` list, shared by the components that reach a hook point. The list is EMPTY
unless a variable asks for an observer. Each hook point in production code is a single
call that loops over the list, so a server that asks for no diagnostic runs none of
their code and holds none of their state.

    before_step(runtime, batch)  a decode step's Kara work begins (its running batch)
    after_step()                 ... and has ended, also when it raised
    protected(req, state)        a request's protected prefix P was just fixed
    planned(jobs) -> jobs        an event's jobs, before the ranks agree on them
    stage(name, jobs)            an event's chunk reaches ``score`` (before the rest of
                                 its windows is scored) or ``commit`` (K/V copied, its
                                 rows not yet rewritten); a hook that raises fails the
                                 chunk there, as any failure of it would
    fenced()                     the step's fence: later work runs after the forward
    staged(tensor)               DeviceStaging copied host values: the device tensor
    after_event(reqs)            an event pass has run over the running requests
    meta(state, meta)            a finished request's ``meta_info["kara"]`` being built
    stats() -> dict              counters merged into this replica's /server_info state
"""

from __future__ import annotations


class StepObserver:
    """Every hook point, each doing nothing: a diagnostic overrides those it needs."""

    def before_step(self, runtime, batch) -> None:
        pass

    def after_step(self) -> None:
        pass

    def protected(self, req, state) -> None:
        pass

    def planned(self, jobs: list) -> list:
        return jobs

    def stage(self, name: str, jobs) -> None:
        pass

    def fenced(self) -> None:
        pass

    def staged(self, tensor) -> None:
        pass

    def after_event(self, reqs) -> None:
        pass

    def meta(self, state, meta: dict) -> None:
        pass

    def stats(self) -> dict:
        return {}


class Observers(list):
    """The runtime's observers, in registration order. Each hook point is one loop over
    them (empty in production, so the loop does nothing)."""

    def before_step(self, runtime, batch) -> None:
        for observer in self:
            observer.before_step(runtime, batch)

    def after_step(self) -> None:
        """In reverse order, so that observers which wrap the step nest."""
        for observer in reversed(self):
            observer.after_step()

    def protected(self, req, state) -> None:
        for observer in self:
            observer.protected(req, state)

    def planned(self, jobs: list) -> list:
        for observer in self:
            jobs = observer.planned(jobs)
        return jobs

    def stage(self, name: str, jobs) -> None:
        for observer in self:
            observer.stage(name, jobs)

    def fenced(self) -> None:
        for observer in self:
            observer.fenced()

    def staged(self, tensor) -> None:
        for observer in self:
            observer.staged(tensor)

    def after_event(self, reqs) -> None:
        for observer in self:
            observer.after_event(reqs)

    def meta(self, state, meta: dict) -> None:
        for observer in self:
            observer.meta(state, meta)

    def stats(self) -> dict:
        out: dict = {}
        for observer in self:
            out.update(observer.stats())
        return out
