"""The SGLang surface the package touches, derived from its code (AST) and held to what the
adapters declare (sgl_kara/_sglang.py for the core, sgl_kara/cpu/_sglang.py for the CPU kit).

- Outside the adapters, no module reads or writes an attribute that only SGLang's runtime objects
  have: every ``req.kv.kv_committed_len`` goes through the adapter.
- In an adapter, every attribute its code touches on an SGLang object is declared (its
  ``ATTRIBUTES``, or ``SERVER_ARGS`` for ServerArgs fields), and every declared one is used.
- The ServerArgs fields the start-up reads (``server_args.x``, ``getattr(server_args, "x")``, the
  refusal table) are the declared public flags.
- No private SGLang attribute is written but the ones patches/ justifies.
- The core's runtime-object surface stays within the size patches/README.md accounts for, each
  name in its table.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
from pathlib import Path

import pytest
import torch

import sgl_kara

ROOT = Path(sgl_kara.__file__).parent
CORE_ADAPTER = ROOT / "_sglang.py"
KIT_ADAPTER = ROOT / "cpu" / "_sglang.py"
# Private attributes written on SGLang objects, each with its note in patches/.
PRIVATE_WRITES = {"_is_cpu": "patches/cpu.md"}
# The core's runtime-object surface: patches/README.md, "The SGLang surface", gives every name's
# reason. Growing it is a decision, taken there.
CORE_SURFACE_LIMIT = 80
SERVER_ARGS_LIMIT = 32


def _modules(pattern="**/*.py"):
    return sorted(p for p in ROOT.glob(pattern) if "__pycache__" not in p.parts)


def _kara_names() -> set[str]:
    """Names sgl_kara itself defines as attributes: its functions, methods, class attributes,
    dataclass fields and ``self.x`` assignments (a name both sides use cannot be told apart)."""
    names = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return names


def _generic_names() -> set[str]:
    """Attributes of torch tensors and modules, of Python's builtin types and of asyncio's
    tasks and loops."""
    names = set(dir(torch.Tensor)) | set(dir(torch.nn.Module)) | set(dir(torch))
    for t in (list, dict, str, tuple, set, int, float, bytes, object, type):
        names |= set(dir(t))
    names |= set(dir(asyncio.Task)) | set(dir(asyncio.AbstractEventLoop))
    return names | set(dir(builtins))


def _declared(adapter) -> dict[str, set[str]]:
    return {owner: set(names) for owner, names in adapter.ATTRIBUTES.items()}


def _attributes(path: Path) -> list[tuple[int, str, bool]]:
    """(line, attribute, is a write) of every ``x.attr`` not rooted at an imported module."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                name = a.asname or a.name
                if name[:1].islower():
                    modules.add(name)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in modules | {"self", "cls"}:
            continue
        out.append((node.lineno, node.attr, isinstance(node.ctx, ast.Store)))
    return out


def _getattr_names(path: Path, objects: set[str]) -> set[str]:
    """Names read with ``getattr(obj, "name", ...)`` on a variable named in ``objects``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in objects
            and isinstance(node.args[1], ast.Constant)
        ):
            out.add(node.args[1].value)
    return out


@pytest.fixture(scope="module")
def adapters():
    from sgl_kara import _sglang as core
    from sgl_kara.cpu import _sglang as kit

    return core, kit


def _sglang_only(core, kit) -> set[str]:
    names = set().union(*_declared(core).values(), *_declared(kit).values())
    return names - _kara_names() - _generic_names()


def _touches(path: Path, names: set[str], server_args: set[str]) -> list[str]:
    """``path``'s attribute accesses named in ``names`` (a ServerArgs field read on a server-args
    variable is a flag, not a runtime object)."""
    tree = ast.parse(path.read_text())
    flags = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in SERVER_ARGS_OBJECTS
            and node.attr in server_args
        ):
            flags.add((node.lineno, node.attr))
    return [
        f"{path.relative_to(ROOT)}:{line} .{attr}"
        for line, attr, _ in _attributes(path)
        if attr in names and (line, attr) not in flags
    ]


def test_the_core_reads_sglang_objects_only_through_its_adapter(adapters):
    core, kit = adapters
    sglang_only = _sglang_only(core, kit)
    assert "kv_committed_len" in sglang_only and "req_pool_idx" in sglang_only
    bad = []
    for path in _modules():
        if path == CORE_ADAPTER or "cpu" in path.relative_to(ROOT).parts:
            continue
        bad += _touches(path, sglang_only, set(core.SERVER_ARGS))
    assert not bad, bad


def test_the_cpu_kit_touches_only_what_its_adapter_declares(adapters):
    """The kit's hooks work on SGLang's layers directly (packed weights, the torch_native
    backend): each name it touches is declared in the kit's adapter."""
    core, kit = adapters
    sglang_only = _sglang_only(core, kit) - set().union(*_declared(kit).values())
    bad = []
    for path in _modules("cpu/*.py"):
        if path != KIT_ADAPTER:
            bad += _touches(path, sglang_only, set(core.SERVER_ARGS))
    assert not bad, bad


SERVER_ARGS_OBJECTS = {"server_args", "resolved", "args", "probe"}


@pytest.mark.parametrize("which", ["core", "cpu"])
def test_every_sglang_attribute_an_adapter_touches_is_declared(adapters, which):
    core, kit = adapters
    adapter, path = (core, CORE_ADAPTER) if which == "core" else (kit, KIT_ADAPTER)
    declared = set().union(*_declared(adapter).values()) | set(core.SERVER_ARGS)
    own = _kara_names() | _generic_names()
    touched = {attr for _, attr, _ in _attributes(path)} - own
    touched |= _getattr_names(path, {"req", "batch", "scheduler", "engine", "manager"})
    missing = sorted(touched - declared - own)
    assert not missing, f"declare these in {path.relative_to(ROOT)}: {missing}"


def test_every_declared_attribute_is_used(adapters):
    """A declared name no code of the package touches is stale (the declaration lies)."""
    core, kit = adapters
    code = "\n".join(p.read_text() for p in _modules())
    stale = [
        f"{owner}.{name}"
        for adapter in (core, kit)
        for owner, names in adapter.ATTRIBUTES.items()
        for name in names
        if f".{name}" not in code
        and f'"{name}"' not in code.replace(f'"{name}",\n', "")
    ]
    assert not stale, stale


def test_server_args_read_by_the_start_up_are_the_declared_flags(adapters):
    core, _ = adapters
    from sgl_kara import startup

    read = set()
    for path in (
        ROOT / "startup.py",
        ROOT / "server_setup.py",
        ROOT / "cpu" / "server.py",
        ROOT / "launch_server.py",
        ROOT / "engine.py",
    ):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in SERVER_ARGS_OBJECTS
            ):
                read.add(node.attr)
        read |= _getattr_names(path, SERVER_ARGS_OBJECTS)
    read |= {name for name, *_ in startup._UNSUPPORTED}
    read -= {"resolve_once"}  # ServerArgs' own method: SGLang's resolution
    missing = sorted(read - set(core.SERVER_ARGS))
    assert not missing, f"declare these ServerArgs fields in SERVER_ARGS: {missing}"
    from sglang.srt.server_args import ServerArgs

    fields = set(ServerArgs.__annotations__)
    assert set(core.SERVER_ARGS) <= fields, set(core.SERVER_ARGS) - fields


def test_no_private_sglang_attribute_is_written_without_its_note(adapters):
    written = {}
    for path in _modules():
        for line, attr, store in _attributes(path):
            if store and attr.startswith("_") and not attr.startswith("__"):
                written.setdefault(attr, []).append(f"{path.relative_to(ROOT)}:{line}")
    own = _kara_names()
    private = {a: where for a, where in written.items() if a not in own}
    assert set(private) <= set(PRIVATE_WRITES), private
    for note in PRIVATE_WRITES.values():
        assert (ROOT.parent / note).is_file(), note


def test_the_declared_surface_is_the_one_patches_accounts_for(adapters):
    core, kit = adapters
    runtime = sum(len(v) for v in core.ATTRIBUTES.values())
    assert runtime <= CORE_SURFACE_LIMIT, runtime
    assert len(core.SERVER_ARGS) <= SERVER_ARGS_LIMIT, len(core.SERVER_ARGS)
    index = (ROOT.parent / "patches" / "README.md").read_text()
    index = index[index.index("## The SGLang surface") :]
    for owner in core.ATTRIBUTES:
        assert owner.rsplit(".", 1)[-1] in index, f"patches/README.md misses {owner}"
    for owner, names in core.ATTRIBUTES.items():
        row = next(
            (
                line
                for line in index.splitlines()
                if f"`{owner.rsplit('.', 1)[-1]}`" in line
            ),
            "",
        )
        assert all(n in row for n in names), (owner, row)
