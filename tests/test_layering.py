"""The package's structure: imports only point down the layers, and every SGLang touch point
named in sgl_kara/_sglang.py still exists in the installed SGLang (a version bump fails here
first, fast, instead of deep inside a scheduler process).

    wiring      launch_server, engine, plugin, support, memory      may import anything below
    process     per-process state (process.py)                       nothing of sgl_kara or SGLang
    scheduler   runtime glue                                         config, mem_cache, policies, kernels
    cpu         CPU serving hooks (attention, linear, threads)       env, _sglang (no Kara state)
    models      default and fixture checkpoints                      env (no SGLang, no Kara state)
    mem_cache   compaction, radix cap, integrity                     config, kernels (not scheduler)
    config      KaraConfig                                           policies
    policies    pure algorithms, the policy contract                 kernels only
    kernels     Triton kernels and torch references                  nothing of sgl_kara
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

ROOT = Path(sgl_kara.__file__).parent

FORBIDDEN = {
    "kernels": ("sgl_kara", "sglang"),
    "policies": ("sgl_kara.config", "sgl_kara.mem_cache", "sgl_kara.scheduler", "sgl_kara._sglang", "sglang",
                 "sgl_kara.support", "sgl_kara.memory"),
    "config.py": ("sgl_kara.mem_cache", "sgl_kara.scheduler", "sgl_kara._sglang", "sglang"),
    "mem_cache": ("sgl_kara.scheduler",),
    "process.py": ("sgl_kara", "sglang"),
    "cpu": ("sgl_kara.scheduler", "sgl_kara.mem_cache", "sgl_kara.policies", "sgl_kara.config", "sgl_kara.kernels",
            "sgl_kara.support", "sgl_kara.memory", "sgl_kara.plugin", "sgl_kara.engine", "sgl_kara.launch_server"),
    "models": ("sglang", "sgl_kara._sglang", "sgl_kara.scheduler", "sgl_kara.mem_cache", "sgl_kara.policies",
               "sgl_kara.config", "sgl_kara.kernels", "sgl_kara.cpu", "sgl_kara.support", "sgl_kara.plugin",
               "sgl_kara.engine", "sgl_kara.launch_server"),
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
    files = [ROOT / layer] if layer.endswith(".py") else sorted((ROOT / layer).rglob("*.py"))
    bad = []
    for path in files:
        for name in _imports(path):
            allowed_self = layer == "kernels" and name.startswith("sgl_kara.kernels")
            if not allowed_self and any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def _has_attribute(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if inspect.isclass(owner):
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
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


def test_every_sglang_touch_point_exists():
    from sgl_kara import _sglang as sg

    missing = []
    for path, names in sg.ATTRIBUTES.items():
        try:
            owner = importlib.import_module(path)
        except ImportError:
            mod, _, cls = path.rpartition(".")
            owner = getattr(importlib.import_module(mod), cls)
        missing += [f"{path}.{n}" for n in names if not _has_attribute(owner, n)]
    targets = [v for k, v in vars(sg).items() if k.startswith("TARGET_")]
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
    assert all(f"({n})" in index for n in notes), sorted(n for n in notes if f"({n})" not in index)
