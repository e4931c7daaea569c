"""sgl_kara.process: the one owner of per-process state. The trace file is opened at the first
traced step and closed at shutdown (the scheduler's exit, or atexit), the runtime is what the
hooks see through runtime.active(), the serving policy is what the request checks use, and the
plugin's registered parts are what ``register()`` adds once each, as the environment asks."""

from __future__ import annotations

import atexit
import json
import os
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
    monkeypatch.setattr(
        atexit, "register", lambda fn, *a, **kw: registered.append(fn) or fn
    )
    fresh.atexit_calls = registered
    return fresh


def _exit_hooks(state) -> int:
    return sum(1 for fn in state.atexit_calls if getattr(fn, "__self__", None) is state)


def _scheduler(free: int):
    return types.SimpleNamespace(
        waiting_queue=[1, 2],
        metrics_reporter=None,
        token_to_kv_pool_allocator=types.SimpleNamespace(available_size=lambda: free),
    )


def test_trace_file_is_opened_once_and_closed_at_shutdown(state, monkeypatch, tmp_path):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KARA_TRACE", str(path))
    assert not state.trace_open
    for free in (10, 9):
        assert plugin._trace_hook(None, _scheduler(free), None) is None
    f = state._trace
    assert state.trace_open and not f.closed and _exit_hooks(state) == 1
    lines = [
        json.loads(line) for line in path.read_text().splitlines()
    ]  # line-buffered: already on disk
    assert [(r["free"], r["waiting"], r["running"]) for r in lines] == [
        (10, 2, 0),
        (9, 2, 0),
    ]

    state.shutdown()
    assert f.closed and not state.trace_open
    state.shutdown()  # twice is fine
    plugin._trace_hook(
        None, _scheduler(8), None
    )  # a step after shutdown appends to the same file
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
    plugin._verify_hook(
        None, beam
    )  # no policy served by this process: nothing to check
    plugin.set_serving_policy("kara")
    assert state.serving_policy == "kara"
    with pytest.raises(ValueError, match="beam"):
        plugin._verify_hook(None, beam)
    state.shutdown()
    assert state.serving_policy == "kara"  # the front end keeps serving its policy


class _Registry:
    """Stands in for SGLang's HookRegistry: records (target, hook, type)."""

    def __init__(self):
        self.hooks = []

    def register(self, target, hook, hook_type):
        self.hooks.append((target, hook, hook_type))


@pytest.fixture
def registry(state, monkeypatch):
    from sgl_kara import _sglang as adapter
    from sgl_kara.cpu import _sglang as kit
    from sgl_kara.cpu import hooks as cpu_hooks

    fake = _Registry()
    monkeypatch.setattr(adapter, "HookRegistry", fake)
    monkeypatch.setattr(kit, "HookRegistry", fake)
    monkeypatch.setattr(cpu_hooks, "STATE", state)
    monkeypatch.setattr(plugin, "cuda_available", lambda: False)
    monkeypatch.setattr(cpu_hooks, "apply_rope_shim", lambda: fake.hooks.append("rope"))
    monkeypatch.setattr(
        adapter,
        "register_radix_cache_backend",
        lambda name, factory: fake.hooks.append(("radix", name)),
    )
    monkeypatch.setattr(adapter, "registered_radix_cache_backends", lambda: [])
    for name in (
        "KARA_SERVE",
        "KARA_CPU_KERNELS",
        "KARA_TRACE",
        "KARA_PACKED_CPU_LINEAR",
    ):
        monkeypatch.delenv(name, raising=False)
    return fake


def _targets(fake) -> set[str]:
    return {h[0] for h in fake.hooks if isinstance(h, tuple) and h[0] != "radix"}


def test_plain_sglang_gets_the_cpu_start_up_fixes_only(registry):
    """No variable set (plain SGLang with sgl_kara installed): RoPE's CPU path and tensor
    parallelism's start on a CPU, nothing else."""
    from sgl_kara.cpu import hooks as cpu_hooks

    plugin.register()
    plugin.register()
    assert registry.hooks == ["rope", *cpu_hooks.parallel_hooks()]
    assert state_parts(plugin) == {"rope", "parallel"}


def test_a_gpu_process_registers_nothing_of_the_cpu_kit(registry, monkeypatch):
    """With CUDA, even a serving process gets no CPU part (unless KARA_CPU_KERNELS=1 asks)."""
    from sgl_kara.cpu import hooks as cpu_hooks

    monkeypatch.setattr(plugin, "cuda_available", lambda: True)
    monkeypatch.setenv("KARA_SERVE", "1")
    plugin.register()
    assert state_parts(plugin) == {"serving"} and "rope" not in registry.hooks
    assert not _targets(registry) & {t for t, *_ in cpu_hooks.parallel_hooks()}
    want = {t for t, *_ in plugin.HOOKS["serving"]()}
    assert _targets(registry) == want


def state_parts(mod) -> set[str]:
    return set(mod.STATE.parts)


@pytest.mark.parametrize(
    "variables,parts",
    [
        ({"KARA_SERVE": "1"}, {"serving", "cpu_kernels", "packed_linear", "report"}),
        ({"KARA_SERVE": "1", "KARA_CPU_KERNELS": "0"}, {"serving", "report"}),
        ({"KARA_CPU_KERNELS": "1"}, {"cpu_kernels", "packed_linear", "report"}),
        (
            {"KARA_CPU_KERNELS": "1", "KARA_PACKED_CPU_LINEAR": "0"},
            {"cpu_kernels", "report"},
        ),
        ({"KARA_TRACE": "/dev/null"}, {"trace"}),
    ],
)
def test_register_adds_the_parts_the_environment_asks_for_once_each(
    registry, monkeypatch, variables, parts
):
    from sgl_kara.cpu import _sglang as kit
    from sgl_kara.cpu import hooks as cpu_hooks
    from sgl_kara.cpu import linear

    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    plugin.register()
    first = list(registry.hooks)
    plugin.register()  # again (SGLang's loader, then the launcher or Engine): nothing twice
    assert registry.hooks == first and first.count("rope") == 1
    parts = parts | {"rope", "parallel"}
    assert state_parts(plugin) == (
        parts if linear.available() else parts - {"packed_linear"}
    )
    kit_hooks = {
        "parallel": cpu_hooks.parallel_hooks,
        "cpu_kernels": cpu_hooks.cpu_kernel_hooks,
        "report": cpu_hooks.report_hooks,
    }
    want = {
        t
        for p, fn in {**plugin.HOOKS, **kit_hooks}.items()
        if p in parts
        for t, *_ in fn()
    }
    hooks = [h for h in first if isinstance(h, tuple) and h[0] != "radix"]
    assert _targets(registry) == want and len(hooks) == len(
        [
            h
            for p, fn in {**plugin.HOOKS, **kit_hooks}.items()
            if p in parts
            for h in fn()
        ]
    )
    assert (("radix", "kara") in first) == ("serving" in parts)
    assert (kit.TARGET_LINEAR_APPLY in want) == ("packed_linear" in parts)


def test_a_part_asked_for_later_is_added_later(registry, monkeypatch):
    """A process whose plugins loaded plain (a plain sglang.Engine first) and then serves."""
    monkeypatch.setenv("KARA_TRACE", "/dev/null")
    plugin.register()
    assert state_parts(plugin) == {"trace", "rope", "parallel"}
    monkeypatch.setenv("KARA_SERVE", "1")
    monkeypatch.setenv("KARA_CPU_KERNELS", "0")
    plugin.register()
    assert state_parts(plugin) == {"trace", "rope", "parallel", "serving", "report"}
    from sgl_kara.cpu import hooks as cpu_hooks

    want = (
        plugin.HOOKS["trace"]()
        + cpu_hooks.parallel_hooks()
        + plugin.HOOKS["serving"]()
        + cpu_hooks.report_hooks()
    )
    got = [h for h in registry.hooks if isinstance(h, tuple) and h[0] != "radix"]
    assert sorted(t for t, *_ in got) == sorted(t for t, *_ in want)


def test_serving_sets_the_variable_for_the_duration_only(monkeypatch):
    from sgl_kara import _sglang as adapter

    calls = []
    monkeypatch.setattr(adapter, "load_plugins", lambda: calls.append("load"))
    monkeypatch.setattr(
        plugin,
        "register",
        lambda: calls.append(("register", os.environ.get("KARA_SERVE"))),
    )
    monkeypatch.setattr(
        adapter.HookRegistry,
        "apply_hooks",
        classmethod(lambda cls: calls.append("apply")),
    )
    monkeypatch.delenv("KARA_SERVE", raising=False)
    with plugin.serving():
        assert os.environ["KARA_SERVE"] == "1"
    assert "KARA_SERVE" not in os.environ
    assert calls == ["load", ("register", "1"), "apply"]
    monkeypatch.setenv("KARA_SERVE", "0")
    with pytest.raises(RuntimeError):
        with plugin.serving():
            raise RuntimeError
    assert os.environ["KARA_SERVE"] == "0"
