"""No hook or override goes silently uncalled: at start-up (the launcher, ``sgl_kara.Engine``,
Kara's scheduler process) every SGLang callable sgl_kara hooks or overrides is checked to exist on
the installed SGLang with its pinned signature (``server_setup.check_sglang``; the pins are the
adapters' SIGNATURES and, where SGLang has the extension point, EXTENSION_OVERRIDES), and a
mismatch refuses to start in one line naming it.

Faked here on the installed SGLang 0.5.23: an override SGLang no longer has (as 0.5.21 lacks
``Scheduler.get_prefill_adder_class``), a hooked callable whose parameters changed (as 0.5.22's
``LogitsProcessor._compute_lm_head`` has no ``out=``), an extension point whose method sgl_kara
overrides with other parameters. The pins cover every override: sgl_kara's classes with an
SGLang base are found in the package (module-level ones by import, those its factories build by
building them, or from their source where their base is an extension point's class), and every
method they define is a pinned override.

Also in the patched tier (docs/TESTING.md): on the SGLang the upstream series patches, the check
passes with every extension point's overrides in it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import sgl_kara

pytestmark = pytest.mark.patched

ROOT = Path(sgl_kara.__file__).parent
INSTALL = ": pip install 'sglang==0.5.23'"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


@pytest.fixture
def adapter():
    from sgl_kara import _sglang

    return _sglang


@pytest.fixture
def refusal():
    """The start-up check's refusal, as text (None: it passed)."""
    from sgl_kara import server_setup, startup

    def run() -> str | None:
        try:
            server_setup.check_sglang()
        except startup.UnsupportedSGLang as e:
            return str(e)
        return None

    return run


@pytest.fixture
def on_a_cpu(monkeypatch):
    """A serving process here registers the CPU kit's hooks (as on this machine)."""
    from sgl_kara import plugin

    monkeypatch.setattr(plugin, "cuda_available", lambda: False)


def _missing(name: str, kind: str) -> str:
    return f"SGLang's {name} is missing, and sgl_kara's {kind} it would never run"


# ------------------------------------------------------------------ the installed SGLang
def test_the_installed_sglang_matches_every_pin(adapter, refusal, on_a_cpu):
    from sgl_kara import server_setup
    from sgl_kara.cpu import _sglang as kit

    pinned = server_setup.pinned_callables()
    extension = {  # an extension point's overrides, where this SGLang has it
        path
        for point, paths in adapter.EXTENSION_OVERRIDES.items()
        if adapter.has_extension(point)
        for path in paths
    }
    assert set(pinned) == set(adapter.SIGNATURES) | set(kit.SIGNATURES) | extension
    overrides = sorted(p for p, (_, kind) in pinned.items() if kind == "override")
    assert set(overrides) == set(adapter.OVERRIDDEN) | extension
    print(f"{len(pinned)} pinned: {len(overrides)} overrides, the rest hook targets")
    assert refusal() is None


def test_a_gpu_server_checks_the_cores_pins_only(adapter, monkeypatch):
    """Without the CPU kit's hooks (a process with CUDA) only the core's callables are checked:
    a GPU server imports nothing of the kit."""
    from sgl_kara import plugin, server_setup

    monkeypatch.setattr(plugin, "cuda_available", lambda: True)
    monkeypatch.delenv("KARA_CPU_KERNELS", raising=False)
    pinned = server_setup.pinned_callables()
    assert set(pinned) == set(adapter.pins()) and set(adapter.SIGNATURES) <= set(pinned)
    lm_head = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
    assert lm_head not in pinned  # the kit's


def test_every_pinned_callable_has_its_pinned_signature_here(adapter):
    from sgl_kara.cpu import _sglang as kit

    for signatures in (adapter.SIGNATURES, kit.SIGNATURES):
        changed = {
            path: adapter.installed_signature(path)
            for path, want in signatures.items()
            if adapter.installed_signature(path) != want
        }
        assert not changed, changed


# ------------------------------------------------------------------ refusals, faked
@pytest.mark.parametrize(
    "owner, name, line",
    [
        (
            "sglang.srt.managers.scheduler.Scheduler",
            "get_prefill_adder_class",
            _missing("Scheduler.get_prefill_adder_class", "override of"),
        ),
        (
            "sglang.srt.managers.scheduler_components.output_streamer."
            "SchedulerOutputStreamer",
            "is_request_level_customized_info_key",
            _missing(
                "SchedulerOutputStreamer.is_request_level_customized_info_key",
                "override of",
            ),
        ),
        (
            "sglang.srt.managers.schedule_batch.Req",
            "reset_for_retract",
            _missing("Req.reset_for_retract", "hook on"),
        ),
    ],
    ids=["override", "streamer-override", "hook-target"],
)
def test_a_missing_callable_refuses_in_one_line_naming_it(
    monkeypatch, refusal, owner, name, line
):
    import pkgutil

    monkeypatch.delattr(pkgutil.resolve_name(owner), name)
    assert refusal() == line + INSTALL


def test_every_mismatch_is_counted_in_the_one_line(monkeypatch, refusal):
    """SGLang 0.5.21 lacks three overrides: the line names the first and counts the others."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )

    monkeypatch.delattr(Scheduler, "get_prefill_adder_class")
    monkeypatch.delattr(SchedulerOutputStreamer, "is_request_level_customized_info_key")
    text = refusal()
    assert text.splitlines() == [text]
    assert text == (
        _missing("Scheduler.get_prefill_adder_class", "override of")
        + " (and 1 more)"
        + INSTALL
    )


def _lm_head_without_out(self, hidden_states, lm_head, embedding_bias=None):
    """LogitsProcessor._compute_lm_head as SGLang 0.5.22 has it (no ``out=``)."""


def _update_running_batch_changed(self, batch, budget):
    """Scheduler.update_running_batch with a parameter added."""


@pytest.mark.parametrize(
    "owner, name, fake, line",
    [
        (
            "sglang.srt.layers.logits_processor.LogitsProcessor",
            "_compute_lm_head",
            _lm_head_without_out,
            "SGLang's LogitsProcessor._compute_lm_head takes "
            "(self, hidden_states, lm_head, embedding_bias=None), and sgl_kara's hook on "
            "it is made for (self, hidden_states, lm_head, embedding_bias=None, *, "
            "out=None)",
        ),
        (
            _SCHEDULER,
            "update_running_batch",
            _update_running_batch_changed,
            "SGLang's Scheduler.update_running_batch takes (self, batch, budget), and "
            "sgl_kara's hook on it is made for (self, batch)",
        ),
    ],
    ids=["kit-hook", "core-hook"],
)
def test_a_changed_signature_refuses_in_one_line_naming_it(
    monkeypatch, refusal, on_a_cpu, owner, name, fake, line
):
    import pkgutil

    monkeypatch.setattr(pkgutil.resolve_name(owner), name, fake)
    assert refusal() == line + INSTALL


def _pre_decode_step(self, batch):
    """Scheduler.pre_decode_step as the series adds it (patches/upstream 0004)."""


def _pre_decode_step_changed(self, batch, forward_batch):
    """Scheduler.pre_decode_step with a parameter the series does not have."""


def _extra_internal_state(self):
    """Scheduler.extra_internal_state as the series adds it (patches/upstream 0004)."""


@pytest.mark.parametrize(
    "fake, line",
    [
        (_pre_decode_step, None),
        (
            _pre_decode_step_changed,
            "SGLang's Scheduler.pre_decode_step takes (self, batch, forward_batch), and "
            "sgl_kara's override of it is made for (self, batch)",
        ),
    ],
    ids=["as-pinned", "changed"],
)
def test_an_extension_points_override_is_checked_where_sglang_has_it(
    adapter, monkeypatch, refusal, fake, line
):
    """Scheduler.pre_decode_step (0004) is found by feature: where SGLang has it, KaraScheduler
    overrides it, and its signature must be the pinned one; where not, nothing is checked. (One
    extension point alone is a partial series, refused before the pins: that check is left out
    here, test_a_partial_series_is_refused_in_one_line.)"""
    from sglang.srt.managers.scheduler import Scheduler

    from sgl_kara import startup

    monkeypatch.setattr(startup, "check_backend", lambda: None)

    for name in ("pre_decode_step", "extra_internal_state"):  # as plain 0.5.23 has it
        monkeypatch.delattr(Scheduler, name, raising=False)
    monkeypatch.setattr(adapter, "_FOUND", {})
    assert f"{_SCHEDULER}.pre_decode_step" not in adapter.pins()
    monkeypatch.setattr(Scheduler, "pre_decode_step", fake, raising=False)
    monkeypatch.setattr(adapter, "_FOUND", {})
    assert adapter.has_extension("decode_step")
    assert adapter.pins()[f"{_SCHEDULER}.pre_decode_step"] == (
        "(self, batch)",
        "override",
    )
    # the series adds extra_internal_state beside it: missing here, then as the series has it
    missing = _missing("Scheduler.extra_internal_state", "override of")
    if line is None:
        assert refusal() == missing + INSTALL
    else:
        assert refusal() == line + " (and 1 more)" + INSTALL
    monkeypatch.setattr(
        Scheduler, "extra_internal_state", _extra_internal_state, raising=False
    )
    assert refusal() == (None if line is None else line + INSTALL)


def test_a_partial_series_is_refused_in_one_line(adapter, monkeypatch, refusal):
    """SGLang with some of the series' extension points and not the others: no backend serves
    it (half of Kara would run through hooks on an SGLang changed under them), so start-up
    refuses, naming what is missing; with all or none, a backend is chosen."""
    from sgl_kara import backends

    points = list(adapter.EXTENSION_POINTS)
    for have in ([], points):
        monkeypatch.setattr(adapter, "_FOUND", {p: p in have for p in points})
        assert backends.choose().hooked is (not have)
    monkeypatch.setattr(
        adapter, "_FOUND", {p: p in ("decode_step", "kv_tail") for p in points}
    )
    with pytest.raises(backends.PartialSeries):
        backends.choose()
    text = refusal()
    assert text.startswith(
        f"the installed SGLang has 2 of the {len(points)} extension "
    )
    assert "missing: 0001 input_ids, 0002 request_info" in text and "0004" not in text
    assert "\n" not in text
    monkeypatch.setattr(adapter, "_FOUND", {})
    assert refusal() is None
    assert backends.current().hooked is not all(
        adapter.has_extension(p) for p in points
    )


def test_a_hook_applied_or_a_class_replaced_hides_no_mismatch(adapter, monkeypatch):
    """Once a hook wrapped SGLang's method, or KaraScheduler replaced SGLang's Scheduler in its
    module (the class REPLACE hook), the check reads SGLang's own definition still."""
    import functools

    import sglang.srt.managers.scheduler as module

    from sgl_kara.scheduler.kara_scheduler import KaraScheduler

    original = module.Scheduler.update_running_batch

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(module.Scheduler, "update_running_batch", wrapped)
    monkeypatch.setattr(module, "Scheduler", KaraScheduler)
    assert adapter.pin_problems(adapter.pins()) == []
    monkeypatch.delattr(module.Scheduler.__mro__[1], "get_prefill_adder_class")
    assert adapter.pin_problems(adapter.pins()) == [
        _missing("Scheduler.get_prefill_adder_class", "override of")
    ]


# ------------------------------------------------------------------ where it runs
@pytest.fixture
def no_prefill_adder_class(monkeypatch):
    from sglang.srt.managers.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "get_prefill_adder_class")
    return _missing("Scheduler.get_prefill_adder_class", "override of") + INSTALL


def test_the_launcher_refuses_a_missing_override_in_one_line(
    no_prefill_adder_class, monkeypatch, capsys
):
    from sgl_kara import launch_server, plugin

    monkeypatch.delenv("KARA_SERVE", raising=False)
    monkeypatch.setattr(plugin, "serve", lambda: pytest.fail("it started to serve"))
    with pytest.raises(SystemExit) as e:
        launch_server.main(["--model-path", "org/any"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {no_prefill_adder_class}"]


def test_the_engine_refuses_a_missing_override_in_one_line(
    no_prefill_adder_class, monkeypatch
):
    from sgl_kara import engine, startup

    monkeypatch.setattr(engine, "serving", lambda: pytest.fail("it started to serve"))
    with pytest.raises(startup.UnsupportedSGLang) as e:
        engine.Engine(model_path="org/any")
    assert str(e.value) == no_prefill_adder_class


def test_the_scheduler_process_refuses_a_missing_override_in_one_line(
    no_prefill_adder_class, monkeypatch, capsys
):
    from sgl_kara import server_setup
    from sgl_kara.config import KaraConfig
    from sgl_kara.scheduler import kara_scheduler

    monkeypatch.setattr(
        kara_scheduler,
        "run_kara_scheduler_process",
        lambda *a, **kw: pytest.fail("the scheduler started"),
    )
    with pytest.raises(SystemExit) as e:
        server_setup.scheduler_process(KaraConfig())("server_args", "port_args")
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"sgl_kara: error: {no_prefill_adder_class}"
    ]


# ------------------------------------------------------------------ every override pinned
def _classes_with_bases() -> list[tuple[str, ast.ClassDef, bool]]:
    """(module, class, defined at module level) of every class of the package with a base."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        out += [
            (module, node, id(node) in top)
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.bases
        ]
    return out


def _built_output_streamer():
    from sgl_kara import _sglang
    from sgl_kara.scheduler.output import make_output_streamer

    return make_output_streamer(_sglang.SchedulerOutputStreamer)


def _built_prefill_adder():
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from sgl_kara.scheduler.admission import make_prefill_adder

    return make_prefill_adder(PrefillAdder, charge=None)


# Classes the package builds inside a function (their base a parameter, or an extension point's
# class): how to build one on the installed SGLang, or the touch point whose extension point's
# class is its base (built only where SGLang has it; its methods are read from the source).
FACTORY_CLASSES = {
    ("sgl_kara.scheduler.output", "KaraOutputStreamer"): _built_output_streamer,
    ("sgl_kara.scheduler.admission", "KaraPrefillAdder"): _built_prefill_adder,
    ("sgl_kara.scheduler.admission", "KaraReservingAdder"): "admission",
    ("sgl_kara.scheduler.output", "KaraFinalValueStreamer"): "request_info",
    ("sgl_kara.scheduler.retraction", "KaraRetractionPolicy"): "retraction",
    ("sgl_kara.scheduler.forward", "KaraObserver"): "attention",
}


def _is_sglang(cls: type) -> bool:
    return cls.__module__.startswith("sglang.")


def _sglang_subclasses() -> tuple[list[type], dict[str, list[str]]]:
    """sgl_kara's classes with an SGLang base, built; and for each touch point, the methods of
    the classes built on its extension point's class (from the source)."""
    classes, by_point = [], {}
    for module, node, top in _classes_with_bases():
        key = (module, node.name)
        if not top:
            assert key in FACTORY_CLASSES, f"list {key} in FACTORY_CLASSES"
            built = FACTORY_CLASSES[key]
            if isinstance(built, str):
                by_point[built] = [
                    f.name
                    for f in node.body
                    if isinstance(f, ast.FunctionDef) and not f.name.startswith("__")
                ]
            else:
                classes.append(built())
            continue
        cls = getattr(importlib.import_module(module), node.name)
        if any(_is_sglang(base) for base in cls.__mro__):
            classes.append(cls)
    return classes, by_point


def _own_methods(cls: type) -> list[str]:
    """The methods ``cls`` defines itself: its functions (``__init__`` included, the other
    dunders not: they are Python's, not SGLang's)."""
    return [
        name
        for name, value in vars(cls).items()
        if inspect.isfunction(value)
        and (name == "__init__" or not name.startswith("__"))
    ]


def _overridden(cls: type, name: str) -> str | None:
    """The dotted path of the SGLang method ``cls.name`` overrides (None: none here)."""
    base = next((b for b in cls.__mro__[1:] if _is_sglang(b) and name in vars(b)), None)
    return None if base is None else f"{base.__module__}.{base.__qualname__}.{name}"


def _pinned(adapter, path: str) -> bool:
    """Is ``path`` pinned? A class's ``__init__`` may be pinned as the class itself."""
    return path in adapter.SIGNATURES or (
        path.endswith(".__init__")
        and path.removesuffix(".__init__") in adapter.SIGNATURES
    )


def test_every_override_of_sglang_is_pinned(adapter):
    """Every method sgl_kara's SGLang subclasses define overrides a method the installed
    SGLang has, pinned in SIGNATURES (OVERRIDDEN), or an extension point's method, pinned in
    EXTENSION_OVERRIDES; and every pinned override is one of them (no stale pin)."""
    classes, by_point = _sglang_subclasses()
    names = {c.__name__ for c in classes}
    assert {
        "Engine",
        "KaraRadixCache",
        "KaraScheduler",
        "KaraSchedulerOutputStreamer",
        "KaraPrefillAdder",
    } <= names, names
    extension = {p for paths in adapter.EXTENSION_OVERRIDES.values() for p in paths}
    found, unpinned = set(), []
    for cls in classes:
        sglang_base = next(b for b in cls.__mro__ if _is_sglang(b))
        for name in _own_methods(cls):
            path = _overridden(cls, name)
            if path is None:  # SGLang has no such method here: an extension point's
                path = f"{sglang_base.__module__}.{sglang_base.__qualname__}.{name}"
            found.add(path)
            if not (_pinned(adapter, path) or path in extension):
                unpinned.append(f"{cls.__qualname__}.{name} ({path})")
    assert not unpinned, (
        "pin these in sgl_kara/_sglang.py (OVERRIDDEN, or EXTENSION_OVERRIDES for an "
        f"extension point's method): {unpinned}"
    )
    for point, methods in by_point.items():
        pinned_names = sorted(
            p.rsplit(".", 1)[1] for p in adapter.EXTENSION_OVERRIDES[point]
        )
        assert sorted(methods) == pinned_names, (point, methods, pinned_names)
        found |= set(adapter.EXTENSION_OVERRIDES[point])
    stale = {
        p for p in adapter.OVERRIDDEN if p not in found and f"{p}.__init__" not in found
    }
    # the process function sgl_kara hands SGLang wraps SGLang's (no class to override)
    assert stale == {"sglang.srt.managers.scheduler.run_scheduler_process"}, stale
    assert extension <= found, extension - found
