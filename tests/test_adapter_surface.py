"""The SGLang surface the package touches, derived from its code (AST) and held to what the
adapters declare (sgl_kara/_sglang.py for the core, sgl_kara/cpu/_sglang.py for the CPU kit).

The core's adapter is ``_sglang.py`` with the hooked backend (``backends/hooked.py``: what only
plain SGLang needs). The core is derived by object: in its adapter every attribute read or written on an SGLang object
counts -- a variable named for one (``req``, ``batch``, ``scheduler``, ...; every adapter
function names its parameters so), an attribute whose value is one (``req.kv``,
``scheduler.tree_cache``, SchedulerParts' ``self.allocator``), a class imported from SGLang
(``ForwardMode.EXTEND``), what an SGLang function returns -- and every name given to ``getattr``
/ ``setattr`` / ``hasattr`` on one; names sgl_kara also defines (``reqs``, ``seq_lens``,
``positions``) are told apart by the object they are read from, not hidden.

- Outside the adapters no module of the core touches an SGLang object: nothing is read from a
  variable or a field of sgl_kara's that holds one (``job.req.rid`` goes through the adapter).
- The core's adapter declares exactly what it touches (ATTRIBUTES; ServerArgs fields in
  SERVER_ARGS), the kit's every SGLang-only name it touches.
- Every ServerArgs write goes through the adapter (``set_server_arg``); the start-up reads only
  the declared flags.
- No private attribute is written on an SGLang object outside the CPU kit; the kit's, each with
  its note in patches/.
- The size: counted on plain SGLang 0.5.23 and with the upstream series applied
  (patches/upstream) and reported, every name counted declared; patches/README.md accounts for
  every declared name and states the counts. No limit is set on them: what holds the surface
  instead is that nothing sgl_kara hooks or overrides can go silently uncalled
  (tests/test_sglang_pins.py).
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
HOOKED = ROOT / "backends" / "hooked.py"  # the hooked side's part of the core's adapter
KIT_ADAPTER = ROOT / "cpu" / "_sglang.py"
# What plain SGLang alone needs read or written, the hooked backend's functions
HOOK_SIDE = (
    "batch_kind",
    "batch_rows",
    "host_lengths",
    "positions",
    "set_positions",
    "kv_writes_to",
    "recompute_batch",
    "run_eager",
    "drop_rows",
    "shrink_lengths",
    "max_new_tokens_as",
    "add_internal_state",
    "vocab_size",
    "release_loop_tasks",
)
# Private attributes written on SGLang objects (by the CPU kit only), each with its note.
PRIVATE_WRITES = {
    "_is_cpu": "patches/cpu.md",
    "_sgl_kara_decode_rows": "patches/cpu_decode_attention.md",
    "_sgl_kara_decode_bufs": "patches/cpu_decode_attention.md",
}
SERVER_ARGS_LIMIT = 32

# Variables of the core's adapter that hold SGLang objects, and attributes whose value is an
# SGLang object too (so a chain ``req.kv.kv_committed_len`` counts both of its names).
SGLANG_VARIABLES = {
    "req",
    "batch",
    "forward_batch",
    "scheduler",
    "layer",
    "model",
    "runner",
    "model_runner",
    "allocator",
    "manager",
    "tokenizer_manager",
    "engine",
    "result",
    "params",
    "mode",
    "pool",
    "reporter",
}
# SGLang objects that are torch modules: torch's own methods on them are not SGLang's names.
TORCH_MODULES = {"model"}
HOLDS_SGLANG = {
    "kv",
    "sampling_params",
    "sampling_info",
    "tp_worker",
    "model_runner",
    "token_to_kv_pool_allocator",
    "req_to_token_pool",
    "tree_cache",
    "model_config",
    "metrics_reporter",
    "tokenizer_manager",
    "forward_mode",
    # SchedulerParts' fields holding SGLang's objects (``self.<field>`` in the adapter)
    "scheduler",
    "allocator",
    "kv_pool",
    "model",
}
# Where the core outside its adapter keeps an SGLang object in a field of its own.
KARA_FIELDS_HOLDING_SGLANG = {
    "req",
    "scheduler",
    "scoring_batch",
    "kv_pool",
    "allocator",
}
# The core's modules, outside the adapter, whose variables of these names are sgl_kara's own (a
# policy's layer index, a Region named ``req``-less): listed, not guessed.
OWN_VARIABLES = {
    "policies": {"layer", "model", "params", "mode", "result"},
    "kernels": {"layer", "model", "params", "mode", "result", "pool"},
    "config.py": {"params", "mode"},
    "model_shape.py": {"model", "params"},
    "memory_plan.py": {"model", "pool"},
}
SERVER_ARGS_OBJECTS = {"server_args", "resolved", "args", "probe"}


def _modules(pattern="**/*.py"):
    return sorted(p for p in ROOT.glob(pattern) if "__pycache__" not in p.parts)


def _core_modules():
    return [
        p
        for p in _modules()
        if p not in (CORE_ADAPTER, HOOKED) and "cpu" not in p.relative_to(ROOT).parts
    ]


def _declared(adapter) -> dict[str, set[str]]:
    return {owner: set(names) for owner, names in adapter.ATTRIBUTES.items()}


@pytest.fixture(scope="module")
def adapters():
    from sgl_kara import _sglang as core
    from sgl_kara.cpu import _sglang as kit

    return core, kit


# ------------------------------------------------------------------ the core, by object
def _sglang_imports(tree) -> tuple[set[str], set[str]]:
    """(classes and objects, functions) a file imports from SGLang."""
    objects, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "sglang"
        ):
            for a in node.names:
                name = a.asname or a.name
                (objects if name[:1].isupper() else functions).add(name)
    return objects, functions


def _is_sglang(expr, objects: set[str], functions: set[str]) -> bool:
    """Does ``expr`` (in the core's adapter) evaluate to an SGLang object?"""
    if isinstance(expr, ast.Name):
        return expr.id in SGLANG_VARIABLES or expr.id in objects
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id == "self":
            return expr.attr in HOLDS_SGLANG
        return expr.attr in HOLDS_SGLANG and _is_sglang(expr.value, objects, functions)
    if isinstance(expr, ast.Call):  # what an SGLang function returns
        return isinstance(expr.func, ast.Name) and expr.func.id in functions
    return False


def _reflective(node) -> tuple[ast.AST, str] | None:
    """(object, name) of ``getattr`` / ``setattr`` / ``hasattr(object, "name", ...)``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[0], node.args[1].value
    return None


def core_touches(path: Path = CORE_ADAPTER) -> dict[str, set[int]]:
    """Every SGLang attribute name a file of the core's adapter touches -> its lines."""
    tree = ast.parse(path.read_text())
    objects, functions = _sglang_imports(tree)
    out: dict[str, set[int]] = {}
    for node in ast.walk(tree):
        found = None
        if isinstance(node, ast.Attribute):
            found = (node.value, node.attr)
        else:
            found = _reflective(node)
        if found is None or not _is_sglang(found[0], objects, functions):
            continue
        obj, name = found
        torch_module = (isinstance(obj, ast.Name) and obj.id in TORCH_MODULES) or (
            isinstance(obj, ast.Attribute) and obj.attr in TORCH_MODULES
        )
        if torch_module and name in TORCH_MODULE_NAMES:
            continue
        out.setdefault(name, set()).add(node.lineno)
    return out


TORCH_MODULE_NAMES = set(dir(torch.nn.Module))


def test_the_core_adapter_declares_exactly_what_it_touches(adapters):
    """Every SGLang name the adapter's code touches is declared (ATTRIBUTES; ServerArgs fields
    in SERVER_ARGS), and every declared runtime name is touched."""
    core, _ = adapters
    touched = core_touches()
    for name, lines in core_touches(HOOKED).items():
        touched.setdefault(name, set()).update(lines)
    assert {"kv_committed_len", "reqs", "seq_lens", "positions"} <= set(touched)
    declared = set().union(*_declared(core).values())
    missing = sorted(set(touched) - declared - set(core.SERVER_ARGS))
    assert not missing, {n: sorted(touched[n]) for n in missing}
    stale = sorted(declared - set(touched))
    assert not stale, f"declared in ATTRIBUTES, never touched: {stale}"


def _outside_touches(path: Path) -> list[str]:
    """Attribute accesses, and reflective ones, on what holds an SGLang object: a variable
    named for one, or a field of sgl_kara's that keeps one (``job.req``)."""
    rel = path.relative_to(ROOT)
    own = set()
    for key, names in OWN_VARIABLES.items():
        if str(rel) == key or rel.parts[0] == key:
            own |= names
    variables = SGLANG_VARIABLES - own
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        found = (node.value, node.attr) if isinstance(node, ast.Attribute) else None
        found = found or _reflective(node)
        if found is None:
            continue
        target, name = found
        held = (isinstance(target, ast.Name) and target.id in variables) or (
            isinstance(target, ast.Attribute)
            and target.attr in KARA_FIELDS_HOLDING_SGLANG
        )
        if held:
            bad.append(f"{rel}:{node.lineno} .{name}")
    return bad


def test_the_core_reads_sglang_objects_only_through_its_adapter():
    bad = [hit for path in _core_modules() for hit in _outside_touches(path)]
    assert not bad, bad


# ------------------------------------------------------------------ the CPU kit
def _kara_names() -> set[str]:
    """Names sgl_kara itself defines as attributes: its functions, methods, class attributes,
    dataclass fields and ``self.x`` assignments."""
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


def test_the_cpu_kit_touches_only_what_its_adapter_declares(adapters):
    """The kit's hooks work on SGLang's layers directly (packed weights, the torch_native
    backend): each SGLang-only name it touches is declared in the kit's adapter."""
    core, kit = adapters
    names = set().union(*_declared(core).values(), *_declared(kit).values())
    sglang_only = names - _kara_names() - _generic_names()
    sglang_only -= set().union(*_declared(kit).values())
    bad = []
    for path in _modules("cpu/*.py"):
        if path == KIT_ADAPTER:
            continue
        flags = {  # a ServerArgs field read on a server-args variable is a flag
            (node.lineno, node.attr)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in SERVER_ARGS_OBJECTS
            and node.attr in core.SERVER_ARGS
        }
        bad += [
            f"{path.relative_to(ROOT)}:{line} .{attr}"
            for line, attr, _ in _attributes(path)
            if attr in sglang_only and (line, attr) not in flags
        ]
    assert not bad, bad


def test_every_declared_kit_attribute_is_used(adapters):
    """A declared name no code of the kit touches is stale (the declaration lies)."""
    _, kit = adapters
    code = "\n".join(p.read_text() for p in _modules("cpu/*.py"))
    stale = [
        f"{owner}.{name}"
        for owner, names in kit.ATTRIBUTES.items()
        for name in names
        if f".{name}" not in code
        and f'"{name}"' not in code.replace(f'"{name}",\n', "")
    ]
    assert not stale, stale


# ------------------------------------------------------------------ ServerArgs
def _server_args_writes(path: Path) -> list[str]:
    """Writes to a ServerArgs variable's fields: ``args.x = ...``, ``setattr(args, ...)``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in SERVER_ARGS_OBJECTS
        ):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr} =")
        found = _reflective(node)
        if (
            found is not None
            and node.func.id == "setattr"
            and isinstance(found[0], ast.Name)
            and found[0].id in SERVER_ARGS_OBJECTS
        ):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} setattr {found[1]}")
    return out


def test_every_server_args_write_goes_through_the_adapter():
    """Outside ``_sglang.set_server_arg`` (which writes a declared field by name) no module
    writes a ServerArgs field."""
    writes = [hit for path in _modules() for hit in _server_args_writes(path)]
    assert not writes, writes
    tree = ast.parse(CORE_ADAPTER.read_text())
    setter = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "set_server_arg"
    )
    assert any(
        isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr"
        for n in ast.walk(setter)
    )


def _getattr_names(path: Path, objects: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        found = _reflective(node)
        if found and isinstance(found[0], ast.Name) and found[0].id in objects:
            out.add(found[1])
    return out


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
    assert len(core.SERVER_ARGS) <= SERVER_ARGS_LIMIT, len(core.SERVER_ARGS)


# ------------------------------------------------------------------ private writes
def _private_writes(path: Path) -> dict[str, list[str]]:
    """Private attributes written (``x._y = ...``, ``setattr(x, "_y", ...)``, a name held in a
    constant too) on anything but ``self`` / ``cls``."""
    tree = ast.parse(path.read_text())
    constants = {
        t.id: n.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name) and isinstance(n.value.value, str)
    }
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        name = None
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            )
        ):
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and not (
                isinstance(node.args[0], ast.Name)
                and node.args[0].id in ("self", "cls")
            )
        ):
            arg = node.args[1]
            if isinstance(arg, ast.Constant):
                name = arg.value
            elif isinstance(arg, ast.Name):
                name = constants.get(arg.id)
        if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
            out.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_no_private_sglang_attribute_is_written_outside_the_kit_or_without_its_note():
    core, kit = {}, {}
    for path in _modules():
        into = kit if "cpu" in path.relative_to(ROOT).parts else core
        for name, where in _private_writes(path).items():
            into.setdefault(name, []).extend(where)
    own = _kara_names()
    assert not {n: w for n, w in core.items() if n not in own}, core
    assert set(kit) <= set(PRIVATE_WRITES), set(kit) - set(PRIVATE_WRITES)
    for note in PRIVATE_WRITES.values():
        assert (ROOT.parent / note).is_file(), note


# ------------------------------------------------------------------ the size
def _touches_by_function(path: Path = CORE_ADAPTER) -> dict[str, set[str]]:
    """The SGLang names each function of a file of the core's adapter touches ("" : module
    level)."""
    tree = ast.parse(path.read_text())
    lines = core_touches(path)
    by_line: dict[int, set[str]] = {}
    for name, lns in lines.items():
        for ln in lns:
            by_line.setdefault(ln, set()).add(name)
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spans.append((node.lineno, node.end_lineno, node.name))
    out: dict[str, set[str]] = {}
    for line, names in by_line.items():
        inner = [s for s in spans if s[0] <= line <= s[1]]
        owner = min(inner, key=lambda s: s[1] - s[0])[2] if inner else ""
        out.setdefault(owner, set()).update(names)
    return out


def sides(core) -> dict[str, set[str]]:
    """The names each side touches: on plain SGLang 0.5.23 every function of the adapter but an
    extension point's, and the hooked backend; with the series applied the adapter alone."""
    shared = _touches_by_function()
    hooked = set().union(*_touches_by_function(HOOKED).values())
    return {
        "plain": set().union(
            *(v for f, v in shared.items() if f not in core.EXTENSION_PATH), hooked
        ),
        "patched": set().union(*shared.values()),
    }


def surface(core) -> dict[str, int]:
    """The core's SGLang runtime-object names, counted per owner that declares them: all
    declared, and each side's (``sides``)."""
    owners: dict[str, int] = {}
    for names in core.ATTRIBUTES.values():
        for n in names:
            owners[n] = owners.get(n, 0) + 1
    counts = {
        side: sum(owners.get(n, 0) for n in names)
        for side, names in sides(core).items()
    }
    return {"declared": sum(owners.values()), **counts}


def test_the_sides_of_the_touch_points_are_adapter_functions(adapters):
    """EXTENSION_PATH names functions of the adapter, each of a known touch point; the hooked
    side's functions are the hooked backend's, none of them left in the adapter."""
    core, _ = adapters

    def defined(path):
        return {
            n.name
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }

    side = core.EXTENSION_PATH
    assert set(side) <= defined(CORE_ADAPTER), set(side) - defined(CORE_ADAPTER)
    assert set(side.values()) <= set(core.EXTENSION_POINTS), side
    hook_side = set(HOOK_SIDE)
    assert hook_side <= defined(HOOKED), hook_side - defined(HOOKED)
    assert not hook_side & defined(CORE_ADAPTER), hook_side & defined(CORE_ADAPTER)
    sizes = surface(core)
    assert sizes["plain"] <= sizes["declared"] and sizes["patched"] <= sizes["declared"]
    by_function = _touches_by_function()
    assert (
        "run_cached_extend" in by_function["run_cached_extend"]
    )  # derived, not listed


def test_patches_accounts_for_every_declared_name(adapters):
    core, _ = adapters
    index = (ROOT.parent / "patches" / "README.md").read_text()
    index = index[index.index("## The SGLang surface") :]
    for owner, names in core.ATTRIBUTES.items():
        row = next(
            (
                line
                for line in index.splitlines()
                if line.startswith(f"| `{owner.rsplit('.', 1)[-1]}` |")
            ),
            "",
        )
        assert row, f"patches/README.md misses {owner}"
        missing = [n for n in names if n not in row]
        assert not missing, (owner, missing)
    sizes = surface(core)
    for key in ("declared", "plain", "patched"):
        assert f"**{sizes[key]}**" in index, (key, sizes[key])


def test_the_core_surface_is_counted_and_every_name_declared(adapters, capsys):
    """The core's SGLang names, counted on plain 0.5.23 and with the series applied, and
    reported; every name either side touches is declared (ATTRIBUTES, or a ServerArgs flag)."""
    core, _ = adapters
    sizes = surface(core)
    with capsys.disabled():
        print(
            f"\nthe core's SGLang surface: {sizes['declared']} names declared, "
            f"{sizes['plain']} on plain SGLang 0.5.23, {sizes['patched']} with the series"
        )
    declared = set().union(*_declared(core).values()) | set(core.SERVER_ARGS)
    for side, touched in sides(core).items():
        assert touched, side
        assert touched <= declared, (side, sorted(touched - declared))
    assert all(sizes.values()), sizes
