"""Diagnostics are step observers, registered only where an environment variable asks for
one (sgl_kara/scheduler/observers.py, sgl_kara/diagnostics): with none asked for the runtime
has none; each variable registers its own; an injected ``recompute`` fault still fires
inside the recompute forward, at its middle layer, and is kept on the scoring pass while
the forward runs on (as a real scoring failure is, forward.py); a diagnostic's per-request
row data is cleared by a retraction and its lifetime data is not."""

from __future__ import annotations

import types

import pytest

from sgl_kara.diagnostics import observers_from_env
from sgl_kara.diagnostics.faults import Faults, InjectedFault
from sgl_kara.diagnostics.sync_observer import SyncObserver
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.state import KaraReqState, SideTable

DIAGNOSTICS = (
    "KARA_CHECK_SYNC",
    "KARA_CHECK_INTEGRITY",
    "KARA_CROSSCHECK_QUERIES",
    "KARA_INJECT_FAULT_RID_PREFIX",
    "KARA_INJECT_FAULT_AT",
    "KARA_INJECT_FAULT_TP_RANK",
    "KARA_INJECT_TP_DIVERGENCE",
    "KARA_CHECK_TP_PLAN",
)
LAYERS = 6


class Scorer:
    """A scorer whose recompute forward runs every layer, keeping a scoring failure on the
    pass and going on to the last layer (as forward.py does inside the model)."""

    def __init__(self):
        self.reached: list[int] = []

    def _recompute(self, jobs, rows, scoring, q_lo, n):
        for layer_id in range(LAYERS):
            self.reached.append(layer_id)
            if scoring.error is None:
                try:
                    scoring.score_layer(layer_id, None)
                except Exception as e:  # noqa: BLE001 - as forward.py keeps it
                    scoring.error = e

    def _captured_scores(self, jobs, rows, region_slots, q_starts, n):
        return None


class Pass:
    """A scoring pass that records the layers it scored."""

    def __init__(self):
        self.last_layer, self.error, self.scored = LAYERS - 1, None, []

    def score_layer(self, layer_id, q):
        self.scored.append(layer_id)


def runtime(scorer=None):
    parts = types.SimpleNamespace(tp_rank=0, tp_size=1)
    return types.SimpleNamespace(
        parts=parts, scorer=scorer or Scorer(), table=None, ring=None, forward=None
    )


def job(rid: str):
    return types.SimpleNamespace(req=types.SimpleNamespace(rid=rid))


@pytest.fixture
def clean_env(monkeypatch):
    for name in DIAGNOSTICS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_variable_registers_no_observer(clean_env):
    assert observers_from_env(runtime()) == []
    observers = Observers()
    jobs = [job("a")]
    assert observers.planned(jobs) is jobs and observers.stats() == {}


def test_the_sync_check_is_registered_only_when_asked_for(clean_env):
    clean_env.setenv("KARA_CHECK_SYNC", "1")
    (observer,) = observers_from_env(runtime())
    assert isinstance(observer, SyncObserver)
    assert Observers([observer]).stats()["sync_violations"] == 0


def test_a_recompute_fault_fires_at_the_middle_layer_inside_the_forward(clean_env):
    clean_env.setenv("KARA_INJECT_FAULT_RID_PREFIX", "bad")
    clean_env.setenv("KARA_INJECT_FAULT_AT", "recompute")
    scorer = Scorer()
    (faults,) = observers_from_env(runtime(scorer))
    assert isinstance(faults, Faults)
    faults.stage("score", [job("bad-0")])  # the other stages do not fire
    faults.stage("commit", [job("bad-0")])
    spared = Pass()
    scorer._recompute([job("ok-0")], None, spared, [0], 1)
    assert spared.error is None and spared.scored == list(range(LAYERS))
    hit = Pass()
    scorer.reached.clear()
    scorer._recompute([job("ok-1"), job("bad-1")], None, hit, [0, 0], 1)
    assert isinstance(hit.error, InjectedFault) and "recompute" in str(hit.error)
    middle = (LAYERS - 1) // 2  # the pass's last layer // 2
    assert hit.scored == list(range(middle))  # it raised at the middle layer
    assert scorer.reached == list(range(LAYERS))  # the forward ran on to its end


def test_a_retraction_clears_row_data_and_keeps_lifetime_data():
    state = KaraReqState()
    rows, counts = SideTable(row=True), SideTable()
    rows.set(state, "snapshot")
    counts.set(state, 3)
    assert rows.get(state) == "snapshot" and counts.get(state) == 3
    state.reset_row()
    assert rows.get(state) is None and counts.get(state) == 3
    rows.set(state, "again")
    assert rows.get(state) == "again"
