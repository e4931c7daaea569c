"""The package's structure: imports only point down the layers; the core never imports the CPU
serving kit; only sgl_kara/_sglang.py and sgl_kara/backends/hooked.py (the core's adapter and its
backend for SGLang without the series) and sgl_kara/cpu/_sglang.py (the kit) import SGLang; every
SGLang touch point named there still exists in the installed SGLang, and every SGLang callable
sgl_kara hooks or overrides has the signature recorded there, which its hook or override follows
(a version bump fails here first, fast, instead of deep inside a scheduler process).

    wiring      launch_server, engine, plugin, server_setup           may import anything below
    cpu         the CPU serving kit                                    the core but its scheduler; no wiring
    --- the core: what a GPU server imports ---
    startup     start-up refusals and resolution (startup.py)         config, memory_plan, model_shape
    backends    the SGLang backend chosen at start-up                  the adapter only
    scheduler   runtime glue                                           config, mem_cache, policies, kernels
    mem_cache   compaction, radix cap, integrity                       kernels (not scheduler)
    config      KaraConfig                                             policies
    policies    pure algorithms, the policy contract                   kernels only
    kernels     Triton kernels and torch references                    nothing of sgl_kara
    process     per-process state (process.py)                         nothing of sgl_kara or SGLang
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import sgl_kara
from sgl_kara._sglang import signature_text  # the form the adapters record

ROOT = Path(sgl_kara.__file__).parent
ADAPTERS = ("_sglang.py", "backends/hooked.py", "cpu/_sglang.py")
CORE = (
    "kernels",
    "policies",
    "config.py",
    "mem_cache",
    "scheduler",
    "startup.py",
    "memory_plan.py",
    "model_shape.py",
    "_sglang.py",
    "backends",
    "request_options.py",
    "env.py",
    "process.py",
)
WIRING = (
    "sgl_kara.plugin",
    "sgl_kara.engine",
    "sgl_kara.launch_server",
    "sgl_kara.server_setup",
)
FORBIDDEN = {
    **{layer: ("sgl_kara.cpu",) for layer in CORE},
    "kernels": ("sgl_kara", "sglang"),
    "policies": (
        "sgl_kara.config",
        "sgl_kara.mem_cache",
        "sgl_kara.scheduler",
        "sgl_kara._sglang",
        "sglang",
        "sgl_kara.startup",
        "sgl_kara.cpu",
    ),
    "config.py": (
        "sgl_kara.mem_cache",
        "sgl_kara.scheduler",
        "sgl_kara._sglang",
        "sglang",
        "sgl_kara.cpu",
    ),
    "mem_cache": ("sgl_kara.scheduler", "sgl_kara.cpu"),
    "startup.py": ("sgl_kara.scheduler", "sgl_kara.mem_cache", "sgl_kara.cpu", *WIRING),
    "backends": (
        "sgl_kara.scheduler",
        "sgl_kara.mem_cache",
        "sgl_kara.policies",
        "sgl_kara.startup",
        "sgl_kara.cpu",
        *WIRING,
    ),
    "model_shape.py": ("sgl_kara", "sglang"),
    "process.py": ("sgl_kara", "sglang"),
    "cpu": (*WIRING, "sgl_kara.scheduler"),
}


def _imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    pkg = ".".join(("sgl_kara", *path.relative_to(ROOT).with_suffix("").parts[:-1]))
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                out.append(f"{base}.{node.module}" if node.module else base)
            else:
                out.append(node.module)
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_upward_imports(layer):
    files = (
        [ROOT / layer]
        if layer.endswith(".py")
        else sorted((ROOT / layer).rglob("*.py"))
    )
    bad = []
    for path in files:
        for name in _imports(path):
            allowed_self = layer == "kernels" and name.startswith("sgl_kara.kernels")
            if not allowed_self and any(
                name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_the_cpu_kit_imports_nothing_of_the_scheduler():
    """The CPU serving kit stands beside the core's runtime: no module under sgl_kara/cpu imports
    sgl_kara.scheduler (an import statement, relative or absolute, at any depth) or names it in a
    string (``importlib.import_module``, a ``sys.modules`` lookup). What it needs of a running
    Kara scheduler it reads from the per-process state (process.STATE.recompute_in_flight)."""
    files = sorted((ROOT / "cpu").rglob("*.py"))
    assert len(files) >= 10, files
    bad = []
    for path in files:
        bad += [
            f"{path.relative_to(ROOT)} imports {name}"
            for name in _imports(path)
            if name == "sgl_kara.scheduler" or name.startswith("sgl_kara.scheduler.")
        ]
        bad += [
            f"{path.relative_to(ROOT)} names {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "sgl_kara.scheduler" in node.value
        ]
    assert not bad, bad


def test_only_the_runtime_registers_diagnostics():
    """Diagnostics are step observers that one place registers from the environment
    (KaraRuntime._register_observers): no other module of the core imports
    sgl_kara.diagnostics, and the runtime imports it once."""
    runtime = ROOT / "scheduler" / "runtime.py"
    found = []
    for layer in CORE:
        root = ROOT / layer
        for path in [root] if layer.endswith(".py") else sorted(root.rglob("*.py")):
            found += [
                (path, name)
                for name in _imports(path)
                if name.split(".")[:2] == ["sgl_kara", "diagnostics"]
            ]
    assert [path for path, _ in found] == [runtime], found


def _has_attribute(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if inspect.isclass(owner):
        if dataclasses.is_dataclass(owner) and name in {
            f.name for f in dataclasses.fields(owner)
        }:
            return True
        if name in getattr(owner, "__annotations__", {}):
            return True
        for cls in owner.__mro__:
            try:
                if f"self.{name}" in inspect.getsource(cls):
                    return True
            except (OSError, TypeError):
                continue
    return False


def _adapters():
    from sgl_kara import _sglang as core
    from sgl_kara.cpu import _sglang as kit

    return core, kit


@pytest.mark.parametrize("which", [0, 1], ids=["core", "cpu"])
def test_every_sglang_touch_point_exists(which):
    """Every declared name exists in the installed SGLang; an extension point's own name (each
    patch's marker, patches/upstream) exists exactly where the installed SGLang has the patch."""
    adapter = _adapters()[which]
    points = getattr(adapter, "EXTENSION_POINTS", {})
    markers = {(path, name): point for point, (_, path, name) in points.items()}
    missing = []
    for path, names in adapter.ATTRIBUTES.items():
        for n in names:
            if (path, n) in markers:  # SGLang has it where it has the patch
                assert adapter.has_extension(markers[path, n]) == _has_attribute(
                    pkgutil.resolve_name(path), n
                ), (path, n)
        names = [n for n in names if (path, n) not in markers]
        try:
            owner = importlib.import_module(path)
        except ImportError:
            mod, _, cls = path.rpartition(".")
            owner = getattr(importlib.import_module(mod), cls)
        missing += [f"{path}.{n}" for n in names if not _has_attribute(owner, n)]
    targets = [v for k, v in vars(adapter).items() if k.startswith("TARGET_")]
    for target in [t for v in targets for t in (v if isinstance(v, tuple) else (v,))]:
        mod, _, attr = target.rpartition(".")
        try:
            owner = pkgutil.resolve_name(mod)
        except (ImportError, AttributeError):
            missing.append(target)
            continue
        if not hasattr(owner, attr):
            missing.append(target)
    assert not missing, missing


def test_every_patch_note_is_indexed():
    notes = {p.name for p in (ROOT.parent / "patches").glob("*.md")} - {"README.md"}
    index = (ROOT.parent / "patches" / "README.md").read_text()
    assert all(f"({n})" in index for n in notes), sorted(
        n for n in notes if f"({n})" not in index
    )


def _sglang_imports(path: Path) -> list[str]:
    """``import sglang...`` / ``from sglang... import`` statements in ``path``, and calls of
    ``importlib.import_module`` / ``__import__`` / ``pkgutil.resolve_name`` on a literal SGLang
    name, anywhere in the file (functions included), as "line: what"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            func = node.func
            called = (
                func.attr
                if isinstance(func, ast.Attribute)
                else getattr(func, "id", "")
            )
            if called in ("import_module", "__import__", "resolve_name") and isinstance(
                node.args[0].value, str
            ):
                names = [node.args[0].value]
        found += [
            f"{node.lineno}: {n}"
            for n in names
            if n == "sglang" or n.startswith("sglang.")
        ]
    return found


def test_only_the_sglang_modules_import_sglang():
    adapters = {ROOT / a for a in ADAPTERS}
    bad = {
        str(p.relative_to(ROOT)): hits
        for p in sorted(ROOT.rglob("*.py"))
        if p not in adapters and (hits := _sglang_imports(p))
    }
    assert not bad, bad
    assert all(
        _sglang_imports(a) for a in adapters
    )  # the check sees imports where they are


def _raw(path: str):
    """The SGLang object a dotted path names, as its owner holds it (a class's ``__init__``; a
    classmethod or staticmethod unwrapped to its function; a plugin hook's wrapper to SGLang's own)."""
    owner_path, _, name = path.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    obj = (
        inspect.getattr_static(owner, name)
        if inspect.isclass(owner)
        else getattr(owner, name)
    )
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if inspect.isclass(obj):
        obj = obj.__init__
    return inspect.unwrap(obj)


@pytest.mark.parametrize("which", [0, 1], ids=["core", "cpu"])
def test_every_hooked_or_overridden_sglang_callable_has_the_recorded_signature(which):
    adapter = _adapters()[which]
    targets = [
        t
        for k, v in vars(adapter).items()
        if k.startswith("TARGET_")
        for t in (v if isinstance(v, tuple) else (v,))
    ]
    assert set(targets) | set(getattr(adapter, "OVERRIDDEN", ())) == set(
        adapter.SIGNATURES
    )  # every target has one
    changed = {
        path: (signature_text(_raw(path)), want)
        for path, want in adapter.SIGNATURES.items()
        if signature_text(_raw(path)) != want
    }
    assert not changed, (
        "SGLang signatures differ from sgl_kara/_sglang.py (installed, recorded): "
        + repr(changed)
    )


def _follows(impl, path: str, first: str) -> str | None:
    """Why ``impl`` (a hook: its ``first`` parameter is SGLang's original or result; or an
    override: none) does not take SGLang's parameters as SGLang passes them, else None. Each
    named parameter must be SGLang's parameter at the same place under the same name (the first,
    self / cls, may be renamed: it is always passed by position), keyword-only ones SGLang's
    keyword-only ones; what it does not name, ``*args`` / ``**kwargs`` must take."""
    want = [
        p
        for p in inspect.signature(_raw(path), follow_wrapped=False).parameters.values()
    ]
    got = list(inspect.signature(impl, follow_wrapped=False).parameters.values())
    if first:
        if not got or got[0].name != first:
            return f"first parameter should be {first!r}"
        got = got[1:]
    P = inspect.Parameter
    positional = [
        p for p in got if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    ]
    keyword = {p.name: p for p in got if p.kind == P.KEYWORD_ONLY}
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in got)
    var_kw = any(p.kind == P.VAR_KEYWORD for p in got)
    sg_positional = [
        p for p in want if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) > len(sg_positional):
        return f"takes {len(positional)} positional parameters, SGLang {len(sg_positional)}"
    for i, (mine, theirs) in enumerate(zip(positional, sg_positional)):
        if mine.name != theirs.name and not (i == 0 and theirs.name in ("self", "cls")):
            return f"parameter {i} is {mine.name!r}, SGLang's {theirs.name!r}"
        if (mine.default is P.empty) != (theirs.default is P.empty) and i > 0:
            return f"parameter {mine.name!r}: SGLang's has {'no ' if theirs.default is P.empty else ''}default"
        if theirs.default is not P.empty and mine.default != theirs.default:
            return f"parameter {mine.name!r} defaults to {mine.default!r}, SGLang's to {theirs.default!r}"
    for theirs in sg_positional[len(positional) :]:
        if not (var_pos or var_kw):
            return f"does not take SGLang's {theirs.name!r}"
    for theirs in want:
        if theirs.kind == P.KEYWORD_ONLY and theirs.name not in keyword and not var_kw:
            return f"does not take SGLang's keyword {theirs.name!r}"
        if theirs.kind == P.VAR_KEYWORD and not var_kw:
            return "does not take SGLang's **kwargs"
    extra = [n for n in keyword if n not in {p.name for p in want}]
    if extra:
        return f"keyword parameters SGLang does not have: {extra}"
    return None


def test_every_hook_takes_its_targets_parameters_as_sglang_names_them(monkeypatch):
    from sgl_kara import plugin
    from sgl_kara.cpu import hooks as cpu_hooks

    core, kit = _adapters()
    monkeypatch.setenv(
        "KARA_PACKED_CPU_LINEAR", "1"
    )  # the linear hooks are in the list

    hooks = [h for part in plugin.HOOKS for h in plugin.HOOKS[part]()]
    hooks += (
        cpu_hooks.parallel_hooks()
        + cpu_hooks.cpu_kernel_hooks()
        + cpu_hooks.report_hooks()
    )
    hooks.append(
        (kit.TARGET_SET_ENVS, cpu_hooks._fork_after_set_envs, kit.HookType.AFTER)
    )
    assert {t for t, *_ in hooks} == {
        t
        for adapter in (core, kit)
        for k, v in vars(adapter).items()
        if k.startswith("TARGET_") and k != "TARGET_SCHEDULER"
        for t in (v if isinstance(v, tuple) else (v,))
    }
    first = {
        core.HookType.AROUND: "original",
        core.HookType.AFTER: "result",
        core.HookType.BEFORE: "",
    }
    bad = {
        f"{target} <- {hook.__qualname__}": why
        for target, hook, kind in hooks
        if (why := _follows(hook, target, first[kind]))
    }
    assert not bad, bad


def _overrides():
    """(SGLang path, sgl_kara's method) for every method sgl_kara's SGLang subclasses define over
    one of their SGLang bases."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from sgl_kara import _sglang as adapter
    from sgl_kara.mem_cache.radix import KaraRadixCache
    from sgl_kara.scheduler.admission import make_prefill_adder
    from sgl_kara.scheduler.kara_scheduler import KaraScheduler
    from sgl_kara.scheduler.output import make_output_streamer

    classes = [
        KaraScheduler,
        KaraRadixCache,
        make_output_streamer(adapter.SchedulerOutputStreamer),
        make_prefill_adder(PrefillAdder, charge=None),
    ]
    out = []
    for cls in classes:
        for name, value in vars(cls).items():
            if not inspect.isfunction(value) or name.startswith("__"):
                continue
            base = next(
                (
                    b
                    for b in cls.__mro__[1:]
                    if b.__module__.startswith("sglang.") and name in vars(b)
                ),
                None,
            )
            if base is not None:
                out.append((f"{base.__module__}.{base.__qualname__}.{name}", value))
    return out


def test_every_override_takes_sglangs_parameters():
    from sgl_kara import _sglang as adapter

    overrides = _overrides()
    assert (
        len(overrides) >= 7
    )  # KaraScheduler 2, output streamer 2, prefill adder 2, radix 1
    missing = [path for path, _ in overrides if path not in adapter.SIGNATURES]
    assert not missing, f"record these in sgl_kara/_sglang.py (OVERRIDDEN): {missing}"
    bad = {
        f"{path} <- {fn.__qualname__}": why
        for path, fn in overrides
        if (why := _follows(fn, path, ""))
    }
    assert not bad, bad


GPU_PROCESS = """
import json, os, sys
import torch
import sgl_kara
import sgl_kara._sglang  # SGLang's modules first, as on a GPU machine (their CUDA probes ran)
torch.cuda.is_available = lambda: True  # a machine with CUDA, as far as sgl_kara can tell
os.environ["KARA_SERVE"] = "1"
from sgl_kara import plugin, server_setup
plugin.register()  # what SGLang's plugin loader does in every process
import sgl_kara.engine, sgl_kara.scheduler.kara_scheduler, sgl_kara.scheduler.runtime
from sgl_kara._sglang import HookRegistry
defaults = server_setup.server_defaults(sys.argv[1], {})
try:  # no model path on a GPU: refused, without the kit's default model
    server_setup.default_model_path(server_setup.device_of({}))
    refusal = None
except ValueError as e:
    refusal = str(e)
print(json.dumps({
    "kit": sorted(m for m in sys.modules if m.startswith("sgl_kara.cpu")),
    "hooks": sorted(t for t, hooks in HookRegistry._hooks.items()
                    for _, h, _ in hooks if h.__module__.startswith("sgl_kara")),
    "parts": sorted(plugin.STATE.parts),
    "defaults": defaults,
    "refusal": refusal,
}))
"""


def test_a_gpu_serving_process_imports_and_registers_nothing_of_the_cpu_kit(
    tiny_llama,
):
    """``import sgl_kara`` and what a serving process on a CUDA machine runs (the plugin's
    registration with KARA_SERVE=1, the Engine, the scheduler and its runtime, the server
    defaults, the default model asked for): no module of sgl_kara/cpu is imported, no hook of it
    registered, and a server without a model path is refused, naming the flag."""
    import json
    import subprocess
    import sys

    env = {
        k: v for k, v in __import__("os").environ.items() if not k.startswith("KARA_")
    }
    out = subprocess.run(
        [sys.executable, "-c", GPU_PROCESS, tiny_llama],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kit"] == [], got["kit"]
    assert got["parts"] == ["serving"]
    assert got["hooks"] and not any("cpu" in h for h in got["hooks"]), got["hooks"]
    assert got["defaults"] == {}  # SGLang's own defaults on a GPU
    assert got["refusal"].startswith("no default model on cuda: pass --model-path")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel --no-deps .`` builds from this tree."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(out),
            str(ROOT.parent),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (built,) = out.glob("sgl_kara-*.whl")
    return built


@pytest.mark.integration  # builds the wheel (pip): the integration tier
def test_the_wheel_holds_the_product_only(wheel):
    """``pip wheel --no-deps .`` is under 1 MB and holds no code that downloads a model."""
    import zipfile

    assert wheel.stat().st_size < 1 << 20, wheel.stat().st_size
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert all(n.startswith("sgl_kara") for n in names), names
        assert not any("assets" in n or n.endswith(".safetensors") for n in names)
        code = "\n".join(z.read(n).decode() for n in names if n.endswith(".py"))
    for marker in ("pip download", "urlopen", "hf_hub_download", "snapshot_download"):
        assert marker not in code, marker


def _requires_dist(metadata: str) -> dict[str, str]:
    """Requires-Dist lines of a wheel's METADATA: {requirement: its marker ("" for none)}."""
    out = {}
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req, _, marker = line[len("Requires-Dist:") :].partition(";")
            out[req.strip()] = marker.strip()
    return out


@pytest.mark.integration  # builds the wheel (pip): the integration tier
def test_a_gpu_install_requires_no_conversion_modules(wheel):
    """A GPU install (``pip install sgl_kara``, no extra) requires SGLang alone: the default
    model's conversion modules (gguf, accelerate) only under the extra ``cpu``, as the
    README's commands install it (``.[cpu]``)."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        reqs = _requires_dist(z.read(meta).decode())
    unconditional = sorted(r for r, marker in reqs.items() if not marker)
    assert unconditional == ["sglang==0.5.23"], unconditional
    by_name = {r.split("=")[0].split(">")[0].strip(): m for r, m in reqs.items()}
    for name in ("gguf", "accelerate"):
        assert by_name[name].replace("'", '"') == 'extra == "cpu"', (name, reqs)


# -- one SGLang release at a time ------------------------------------------------------------


def test_the_supported_sglang_is_the_pinned_and_the_installed_one():
    """startup.SGLANG_VERSION is pyproject's pin, and the SGLang these tests run against."""
    import tomllib

    from sgl_kara import startup

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    assert f"sglang=={startup.SGLANG_VERSION}" in project["dependencies"]
    assert startup.installed_sglang_version() == startup.SGLANG_VERSION
    startup.check_sglang_version()  # passes here
    assert startup.SGLANG_VERSION in sgl_kara.__doc__


@pytest.fixture
def other_sglang(monkeypatch):
    """The installed SGLang said to be another release (what the version check reads)."""
    from sgl_kara import startup

    monkeypatch.setattr(startup, "installed_sglang_version", lambda: "0.5.24")
    return "0.5.24"


VERSION_LINE = (
    "sgl_kara supports SGLang 0.5.23 only, and SGLang 0.5.24 is installed: pip install "
    "'sglang==0.5.23', or an sgl_kara release made for SGLang 0.5.24"
)


def test_the_launcher_refuses_another_sglang_in_one_line(
    other_sglang, monkeypatch, capsys
):
    from sgl_kara import launch_server, plugin

    monkeypatch.delenv("KARA_SERVE", raising=False)
    monkeypatch.setattr(plugin, "serve", lambda: pytest.fail("it started to serve"))
    with pytest.raises(SystemExit) as e:
        launch_server.main(["--model-path", "org/any"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {VERSION_LINE}"]
    assert "KARA_SERVE" not in __import__("os").environ  # refused before anything


def test_the_engine_refuses_another_sglang_in_one_line(other_sglang, monkeypatch):
    from sgl_kara import engine, startup

    monkeypatch.setattr(engine, "serving", lambda: pytest.fail("it started to serve"))
    with pytest.raises(startup.UnsupportedSGLang) as e:
        engine.Engine(model_path="org/any")
    assert str(e.value) == VERSION_LINE


def test_the_scheduler_process_refuses_another_sglang_in_one_line(
    other_sglang, monkeypatch, capsys
):
    """Kara's scheduler process function (what the launcher and Engine hand SGLang) checks the
    release in the scheduler process too, before Kara's scheduler or SGLang's runs."""
    from sgl_kara import server_setup
    from sgl_kara.config import KaraConfig
    from sgl_kara.scheduler import kara_scheduler

    monkeypatch.setattr(
        kara_scheduler,
        "run_kara_scheduler_process",
        lambda *a, **kw: pytest.fail("the scheduler started"),
    )
    process = server_setup.scheduler_process(KaraConfig())
    assert process.keywords == {"kara_config": KaraConfig().to_dict()}
    with pytest.raises(SystemExit) as e:
        process("server_args", "port_args")
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"sgl_kara: error: {VERSION_LINE}"]


def test_the_scheduler_process_runs_karas_under_the_supported_sglang(monkeypatch):
    from sgl_kara import server_setup
    from sgl_kara.config import KaraConfig
    from sgl_kara.scheduler import kara_scheduler

    calls = []
    monkeypatch.setattr(
        kara_scheduler,
        "run_kara_scheduler_process",
        lambda *a, **kw: calls.append((a, kw)) or "ran",
    )
    cfg = KaraConfig.build(retention=0.5)
    assert server_setup.scheduler_process(cfg)("sa", "pa", gpu_id=0) == "ran"
    assert calls == [(("sa", "pa"), {"kara_config": cfg.to_dict(), "gpu_id": 0})]


@pytest.mark.parametrize(
    "installed, refused",
    [
        ("0.5.23", None),
        ("0.5.23+cu128", None),  # a local build of the release
        ("0.5.22", "SGLang 0.5.22 is installed"),
        ("0.5.23.post1", "SGLang 0.5.23.post1 is installed"),
        (None, "which is not installed: pip install 'sglang==0.5.23'"),
    ],
)
def test_the_version_check(monkeypatch, installed, refused):
    from sgl_kara import startup

    monkeypatch.setattr(startup, "installed_sglang_version", lambda: installed)
    if refused is None:
        startup.check_sglang_version()
        return
    with pytest.raises(startup.UnsupportedSGLang, match=refused.replace("+", r"\+")):
        startup.check_sglang_version()


def test_plain_sglang_loads_the_plugin_under_another_sglang(other_sglang, monkeypatch):
    """SGLang's own entry point runs the plugin with KARA_SERVE unset: under another release it
    registers its parts as ever (on this CUDA-less machine: RoPE's CPU path and tensor
    parallelism's start), and nothing of it checks the version. Only serving refuses."""
    from sgl_kara import _sglang as core_adapter
    from sgl_kara import plugin, process, startup
    from sgl_kara.cpu import _sglang as kit_adapter
    from sgl_kara.cpu import hooks as cpu_hooks

    fresh = process.ProcessState()
    monkeypatch.setattr(plugin, "STATE", fresh)
    monkeypatch.setattr(cpu_hooks, "STATE", fresh)
    for var in ("KARA_SERVE", "KARA_CPU_KERNELS", "KARA_TRACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(plugin, "cuda_available", lambda: False)
    registered = []
    for adapter in (core_adapter, kit_adapter):
        monkeypatch.setattr(
            adapter, "register_hook", lambda t, h, k: registered.append(t)
        )
    monkeypatch.setattr(cpu_hooks, "apply_rope_shim", lambda: registered.append("rope"))
    plugin.register()
    assert fresh.parts == {"rope", "parallel"}
    assert registered == [
        "rope",
        kit_adapter.TARGET_MODEL_PARALLEL_GROUP,
        kit_adapter.TARGET_THREADS_BINDING,
    ]
    with pytest.raises(startup.UnsupportedSGLang):  # the fake took effect
        startup.check_sglang_version()


def test_the_cpu_kits_declared_names_are_counted_right_in_patches():
    """patches/README.md ("The SGLang surface") states how many attributes the CPU kit's adapter
    declares: the count of sgl_kara/cpu/_sglang.py's ATTRIBUTES."""
    import re

    from sgl_kara.cpu import _sglang as kit

    text = (ROOT.parent / "patches" / "README.md").read_text()
    stated = re.findall(r"CPU serving kit declares its own (\d+)", text)
    assert stated == [str(sum(len(names) for names in kit.ATTRIBUTES.values()))], stated


def test_the_backend_is_the_only_reader_of_what_sglang_offers():
    """Which SGLang this is (the series applied or not) is read where the backend is chosen
    (backends/__init__.py) and by the adapter (its pins); every other module asks the backend."""
    readers = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if "has_extension" in p.read_text()
    )
    assert readers == ["_sglang.py", "backends/__init__.py"], readers


def test_no_function_outside_the_kernels_is_over_60_lines():
    """A function a reader takes in at once: none longer than 60 lines, its docstring included
    (Triton kernels and their launchers, under sgl_kara/kernels, are exempt)."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        if "kernels" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}::{node.name} {lines}")
    assert not long, long


def test_the_runtimes_wiring_is_short():
    """KaraRuntime.__init__ wires the parts (each built from what it uses): at most 40 lines."""
    from sgl_kara.scheduler.runtime import KaraRuntime

    lines, _ = inspect.getsourcelines(KaraRuntime.__init__)
    assert len(lines) <= 40, len(lines)


def test_only_the_state_module_writes_a_requests_state():
    """KaraReqState changes only through its own transitions (fix_protected, open_scoring,
    committed, disable, ...): no other module assigns one of its fields, on any object but its
    own ``self`` (a ForwardContext's ``self.scoring`` is its own)."""
    from sgl_kara.scheduler.state import KaraReqState

    fields = {f.name for f in dataclasses.fields(KaraReqState)}
    writes = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "scheduler/state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in fields
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    writes.append(f"{rel}:{node.lineno} .{t.attr}")
    assert not writes, writes
