"""sgl_kara.process: the one owner of per-process state. The trace file is opened at the first
traced step and closed at shutdown (the scheduler's exit, or atexit), the runtime is what the
hooks see through runtime.active(), and the serving policy is what the request checks use."""

from __future__ import annotations

import atexit
import json
import types

import pytest

from sgl_kara import plugin, process
from sgl_kara.scheduler import runtime


@pytest.fixture
def state(monkeypatch):
    fresh = process.ProcessState()
    monkeypatch.setattr(plugin, "STATE", fresh)
    monkeypatch.setattr(runtime, "STATE", fresh)
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **kw: registered.append(fn) or fn)
    fresh.atexit_calls = registered
    return fresh


def _exit_hooks(state) -> int:
    return sum(1 for fn in state.atexit_calls if getattr(fn, "__self__", None) is state)


def _scheduler(free: int):
    return types.SimpleNamespace(waiting_queue=[1, 2], metrics_reporter=None,
                                 token_to_kv_pool_allocator=types.SimpleNamespace(available_size=lambda: free))


def test_trace_file_is_opened_once_and_closed_at_shutdown(state, monkeypatch, tmp_path):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KARA_TRACE", str(path))
    assert not state.trace_open
    for free in (10, 9):
        assert plugin._trace_hook(None, _scheduler(free), None) is None
    f = state._trace
    assert state.trace_open and not f.closed and _exit_hooks(state) == 1
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # line-buffered: already on disk
    assert [(r["free"], r["waiting"], r["running"]) for r in lines] == [(10, 2, 0), (9, 2, 0)]

    state.shutdown()
    assert f.closed and not state.trace_open
    state.shutdown()  # twice is fine
    plugin._trace_hook(None, _scheduler(8), None)  # a step after shutdown appends to the same file
    assert len(path.read_text().splitlines()) == 3 and _exit_hooks(state) == 1
    state.shutdown()


def test_runtime_is_owned_by_the_process_state_and_shutdown_deactivates_it(state):
    assert runtime.active() is None and plugin._active() is None
    rt = object()
    runtime.activate(rt)
    assert state.runtime is rt and runtime.active() is rt and plugin._active() is rt
    state.shutdown()
    assert runtime.active() is None


def test_serving_policy_decides_the_request_checks(state):
    beam = types.SimpleNamespace(custom_params=None, beam_width=4)
    plugin._verify_hook(None, beam)  # no policy served by this process: nothing to check
    plugin.set_serving_policy("kara")
    assert state.serving_policy == "kara"
    with pytest.raises(ValueError, match="beam"):
        plugin._verify_hook(None, beam)
    state.shutdown()
    assert state.serving_policy == "kara"  # the front end keeps serving its policy


class _Stop(Exception):
    pass


def test_register_runs_once(state, monkeypatch):
    calls = []

    def shim():
        calls.append(1)
        raise _Stop  # before the hooks reach SGLang's registry

    monkeypatch.setattr(plugin, "apply_cpu_shim", shim)
    with pytest.raises(_Stop):
        plugin.register()
    plugin.register()  # already registered: no second set of hooks
    assert calls == [1] and state.registered
