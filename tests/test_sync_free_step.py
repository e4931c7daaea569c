"""A Kara step never makes the host wait for the device (scheduler/sync_check.py).

- The checker itself: a step that copies host values to the device from pageable memory, reads a
  device value on the host or indexes a device tensor with a host one is caught, each named; the
  same work written the sanctioned way (factories on the device, staged copies) is not.
- The source: no module a step runs calls a host read (``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``) or builds a tensor from host values on the device (``torch.tensor(...,
  device=...)``) outside the diagnostics that are allowed to (integrity checks, cross-checks,
  the eviction record) -- an AST check, so a new call fails here before it reaches a GPU.
- The runtime: engines (tiny Llama) under ``KARA_CHECK_SYNC=1``, with capture and with recompute,
  spread and whole events, pages of 1 and 16, H2O's observer: requests compressed several times,
  zero violations counted in every step (integration tier).
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
from support import flush_when_idle

import sgl_kara
from sgl_kara.scheduler.staging import DeviceStaging
from sgl_kara.scheduler.sync_check import SyncCheck

ROOT = Path(sgl_kara.__file__).parent
# The modules a Kara step runs: planning, scoring (captured and recomputed), events and
# compaction, the kernels' launchers, the policies, the adapter's batch edits.
STEP_MODULES = [
    "scheduler/runtime.py",
    "scheduler/plan.py",
    "scheduler/spread.py",
    "scheduler/scoring.py",
    "scheduler/recompute.py",
    "scheduler/events.py",
    "scheduler/forward.py",
    "scheduler/ring.py",
    "scheduler/staging.py",
    "mem_cache/compaction.py",
    "kernels/compact.py",
    "kernels/window_score.py",
    "_sglang.py",
    *[f"policies/{p.name}" for p in (ROOT / "policies").glob("*.py")],
]
HOST_READS = {"item", "tolist", "cpu", "numpy"}
# Functions allowed a host read: diagnostics behind KARA_CHECK_INTEGRITY /
# KARA_CROSSCHECK_QUERIES, value checks of the kernels' launchers on a CPU (``_validate``),
# the ring's integrity check, start-up, the torch / Python references of the kernels and
# policies (tests compare the kernels with them), host-side lists SGLang keeps on the host.
ALLOWED = {
    "scheduler/scoring.py": {"_crosscheck"},
    "scheduler/ring.py": {"check", "make_ring"},
    "scheduler/forward.py": {"check_offsets", "on_forward_batch"},
    "mem_cache/compaction.py": {"host_rows", "slots_of_regions"},
    "kernels/compact.py": {"pointer_table"},
    "_sglang.py": {"shrink_lengths"},
    "policies/kara.py": {"select_ref"},
}


def _fake_step_module(source: str):
    """A module named like the package's (the checker judges sgl_kara's code only)."""
    mod = types.ModuleType("sgl_kara.fake_step")
    sys.modules[mod.__name__] = mod
    exec(compile(source, "fake_step.py", "exec"), mod.__dict__)
    return mod


def test_the_checker_names_each_host_wait():
    mod = _fake_step_module(
        "import torch\n"
        "def step(dev):\n"
        "    a = torch.tensor([1, 2], device=dev.device)\n"
        "    b = dev.sum().item()\n"
        "    c = dev[torch.tensor([0, 1])]\n"
        "    d = torch.tensor([1]).to(dev.device)\n"
        "    e = bool(dev[0] > 0)\n"
        "    f = dev.tolist()\n"
    )
    dev = torch.arange(10)
    check = SyncCheck([dev])
    with check:
        mod.step(dev)
    assert check.violations == 6, check.examples
    text = "\n".join(check.examples)
    for what in (
        "pageable copy",
        "item()",
        "mixes a host tensor",
        "bool()",
        "tolist()",
    ):
        assert what in text, (what, text)


def test_the_checker_accepts_device_side_work_and_staged_copies():
    mod = _fake_step_module(
        "import torch\n"
        "def step(dev, staging):\n"
        "    rows = staging.to_device([0, 2, 4])\n"
        "    offs = torch.arange(3, device=dev.device)\n"
        "    x = dev[rows] + offs\n"
        "    dev[rows] = x.to(torch.int64)\n"
        "    return torch.cat([x, dev[:2]]).sum() * 2\n"
    )
    dev = torch.arange(10)
    check, staging = SyncCheck([dev]), DeviceStaging("cpu")
    staging.on_copy = check.staged
    with check:
        mod.step(dev, staging)
    assert check.violations == 0, check.examples


def _host_waits(path: Path) -> list[str]:
    """Calls of a host read, or of torch.tensor / as_tensor with ``device=``, outside the
    allowed functions of ``path``."""
    rel = str(path.relative_to(ROOT))
    allowed = ALLOWED.get(rel, set())
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call) and name not in allowed:
                f = child.func
                attr = f.attr if isinstance(f, ast.Attribute) else None
                if attr in HOST_READS:
                    found.append(f"{rel}:{child.lineno} {name}: .{attr}()")
                if attr in ("tensor", "as_tensor") and any(
                    k.arg == "device" for k in child.keywords
                ):
                    found.append(f"{rel}:{child.lineno} {name}: torch.{attr}(device=)")
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_no_module_of_the_step_waits_for_the_device():
    found = [hit for m in STEP_MODULES for hit in _host_waits(ROOT / m)]
    assert not found, found


# ------------------------------------------------------------------ the runtime, counted
KARA = dict(kara_window=32, kara_buffer=4, kara_period=8)
CASES = {
    "capture-spread": dict(KARA, kara_query_source="capture"),
    "recompute-spread": dict(KARA, kara_query_source="recompute"),
    "recompute-whole-page16": dict(
        KARA, kara_query_source="recompute", kara_spread="off", page_size=16
    ),
    "h2o": dict(kara_policy="h2o", kara_h2o_threshold=48, kara_h2o_budget=24),
}


@pytest.mark.integration  # an engine per case (docs/TESTING.md, tiers)
@pytest.mark.parametrize("case", sorted(CASES))
def test_no_step_waits_for_the_device(case, tiny_llama, engines):
    engine = engines("kara", tiny_llama, env={"KARA_CHECK_SYNC": "1"}, **CASES[case])
    prompts = [[10 + i, 11, 12, 13, 14, 15, 16, 17 + i] for i in range(4)]
    out = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 96, "temperature": 0, "ignore_eos": True},
    )
    assert all(o["meta_info"]["kara"]["compressions"] >= 2 for o in out), [
        o["meta_info"]["kara"] for o in out
    ]
    assert flush_when_idle(engine)
    stats = engine.get_server_info()["internal_states"][0]["kara"]
    assert stats["events"] > 0
    assert stats["sync_violations"] == 0, stats["sync_examples"]
