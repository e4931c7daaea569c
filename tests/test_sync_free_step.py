"""A Kara step never makes the host wait for the device (sgl_kara/diagnostics/sync_check.py).

- The checker itself: a step that copies host values to the device from pageable memory, reads a
  device value on the host, indexes a device tensor with a host one, runs an operation whose
  size depends on device values (boolean masks, nonzero, unique, one-argument where,
  repeat_interleave without its size) or synchronizes explicitly is caught, each named; the same
  work written the sanctioned way (factories on the device, staged copies) is not. SGLang's own
  calls are judged too: SGLang's paged allocator's ``free`` (a ``torch.unique``) is a violation
  after the step's fence and a pre-fence wait before it; its ``free_page_ids`` is neither.
- The source: no module a step runs calls a host read (``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``) or builds a tensor from host values on the device (``torch.tensor(...,
  device=...)``) outside the diagnostics that are allowed to (integrity checks, cross-checks,
  the eviction record) -- an AST check, so a new call fails here before it reaches a GPU.
- The runtime: engines (tiny Llama) under ``KARA_CHECK_SYNC=1``, with capture and with recompute,
  spread and whole events, pages of 1 and 16, overlap on and off, H2O's observer: requests
  compressed several times, zero violations counted in every step, SGLang's calls inside it
  included (integration tier).
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
from sgl_kara.diagnostics.sync_check import SyncCheck
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.staging import DeviceStaging

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
# Functions allowed a host read: diagnostics behind KARA_CHECK_INTEGRITY, value checks
# of the kernels' launchers on a CPU (``_validate``), the ring's integrity check,
# start-up, the torch / Python references of the kernels and policies (tests compare the
# kernels with them), host-side lists SGLang keeps on the host.
ALLOWED = {
    "scheduler/ring.py": {"check", "make_ring"},
    "scheduler/forward.py": {"check_offsets", "on_forward_batch", "_decode_side_data"},
    "mem_cache/compaction.py": {"host_rows", "slots_of_regions"},
    "kernels/compact.py": {"pointer_table"},
    "backends/hooked.py": {"shrink_lengths"},
    "policies/kara.py": {"select_ref"},
    "policies/numerals.py": {"select_whole_ref"},
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
        "    grid = dev[rows[:, None] + offs[None, :]]\n"
        "    fresh = torch.zeros_like(dev)\n"
        "    fresh[:3] = dev[:3]\n"
        "    x = dev[rows] + offs + grid.sum(1)\n"
        "    dev[rows] = x.to(torch.int64)\n"
        "    return torch.cat([x, dev[:2]]).sum() * 2\n"
    )
    dev = torch.arange(10)
    check = SyncCheck([dev])
    staging = DeviceStaging("cpu", Observers([check]))  # told of each staged copy
    with check:
        mod.step(dev, staging)
    assert check.violations == 0, check.examples


def test_the_checker_names_data_dependent_sizes_and_explicit_syncs():
    mod = _fake_step_module(
        "import torch\n"
        "def step(dev):\n"
        "    a = dev[dev > 3]\n"
        "    b = dev.nonzero()\n"
        "    c = torch.masked_select(dev, dev > 1)\n"
        "    d = torch.where(dev > 2)\n"
        "    e = torch.unique(dev)\n"
        "    f = torch.repeat_interleave(dev, dev)\n"
        "    g = torch.repeat_interleave(dev, dev, output_size=45)\n"
        "    h = torch.where(dev > 2, dev, 0)\n"
        "    dev[dev > 8] = 0\n"
        "    try:\n"
        "        torch.cuda.synchronize()\n"
        "    except Exception:\n"
        "        pass\n"
    )
    dev = torch.arange(10)
    check = SyncCheck([dev])
    with check:
        mod.step(dev)
    text = "\n".join(check.examples)
    assert check.violations == 8, text
    for what in (
        "boolean-mask __getitem__",
        "boolean-mask __setitem__",
        "nonzero",
        "masked_select",
        "one-argument where",
        "unique",
        "repeat_interleave without output_size",
        "torch.cuda.synchronize()",
    ):
        assert what in text, (what, text)
    assert torch.cuda.synchronize.__module__.startswith("torch")  # restored on exit


@pytest.mark.parametrize("page", [1, 16])
def test_sglang_frees_are_judged_at_the_fence(page):
    """SGLang's own allocator inside the step: its paged ``free`` runs ``torch.unique`` on the
    device (a host wait: after the fence a violation, before it a pre-fence wait); the page ids
    compaction frees with (``free_page_ids``) are neither; page size 1 frees without a wait."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sgl_kara.mem_cache.compaction import page_ids

    def allocator():
        if page == 1:
            return TokenToKVPoolAllocator(256, torch.float32, "cpu", None, False)
        return PagedTokenToKVPoolAllocator(256, page, torch.float32, "cpu", None, False)

    waits = {}
    for fenced in (False, True):
        for how in ("free", "free_page_ids"):
            alloc = allocator()
            before = alloc.available_size()
            slots = alloc.alloc(2 * page)
            check = SyncCheck([slots])
            with check:
                if fenced:
                    check.fenced()
                if how == "free":
                    alloc.free(slots)
                else:
                    alloc.free_page_ids(page_ids(slots, page))
            assert alloc.available_size() == before  # both free the two pages
            waits[fenced, how] = (check.violations, check.pre_fence)
    unique = 1 if page > 1 else 0
    assert waits == {
        (False, "free"): (0, unique),
        (True, "free"): (unique, 0),
        (False, "free_page_ids"): (0, 0),
        (True, "free_page_ids"): (0, 0),
    }, waits


def test_sglang_code_is_judged_for_what_it_would_wait_on():
    """SGLang's own code in the step: a blocking copy of host data, a host read or a
    data-dependent size is a wait; a non-blocking copy and work on device state the step was
    not given (weights) are not."""
    mod = types.ModuleType("sglang.fake_forward")
    sys.modules[mod.__name__] = mod
    exec(
        compile(
            "import torch\n"
            "def forward(dev, weight):\n"
            "    a = torch.tensor([1, 2]).to(dev.device, non_blocking=True)\n"
            "    b = dev[:2].float() @ weight\n"
            "    c = torch.tensor([1, 2]).to(dev.device)\n"
            "    d = dev.max().item()\n"
            "    e = dev.nonzero()\n",
            "fake_forward.py",
            "exec",
        ),
        mod.__dict__,
    )
    dev = torch.arange(10)
    check = SyncCheck([dev])
    with check:
        check.fenced()
        mod.forward(dev, torch.ones(2, 2))
    text = "\n".join(check.examples)
    assert check.violations == 3, text
    assert "blocking" in text and "item()" in text and "nonzero" in text, text


def test_a_paged_commit_frees_without_a_wait_and_free_would_not():
    """A page-16 compaction committed after the fence frees its pages by id: no wait. Freed
    with SGLang's ``free`` (a ``torch.unique``) instead, the check fails it."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from sgl_kara.kernels.compact import pointer_table
    from sgl_kara.mem_cache.compaction import CompactionPlan, prepare_compaction

    page, H, D = 16, 2, 4
    counts = {}
    for how in ("free_page_ids", "free"):
        alloc = PagedTokenToKVPoolAllocator(
            512, page, torch.float32, "cpu", None, False
        )
        k = [torch.randn(513, H, D)]
        v = [torch.randn(513, H, D)]
        req_to_token = torch.zeros(2, 128, dtype=torch.int32)
        req_to_token[1, :64] = alloc.alloc(64).to(torch.int32)
        free = alloc.free_page_ids
        if how == "free":

            def free(pages, alloc=alloc):  # pages back to slots, as free() takes them
                slots = pages[:, None] * page + torch.arange(page)
                alloc.free(slots.reshape(-1))

        # what the event hands compaction: indices on the device (staged), rows on the host
        rows, starts = torch.tensor([1]), torch.tensor([16])
        kept = torch.arange(4).expand(1, 1, H, 4)
        pointer_table(k), pointer_table(v)  # built once at start-up (runtime warm-up)
        before = alloc.available_size()
        check = SyncCheck([req_to_token, *k, *v, rows, starts, kept])
        with check:
            plan = CompactionPlan(
                rows,
                [16],
                [60],
                20,
                kept,
                row_ids=[1],
                device_starts=starts,
                region_slots=req_to_token[1, 16:36].to(torch.int64)[None],
            )
            prepared = prepare_compaction(
                plan, req_to_token, k, v, alloc.alloc, free, page, check=False
            )
            check.fenced()
            assert prepared.commit(req_to_token, free) == 16
        # rows [16, 60) of the row held three pages; their 44 - 16 = 28 rows now hold two
        assert alloc.available_size() == before - 2 * page + 3 * page
        counts[how] = check.violations
    assert counts == {"free_page_ids": 0, "free": 1}, counts


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
    "capture-whole-page16": dict(
        KARA, kara_query_source="capture", kara_spread="off", page_size=16
    ),
    "recompute-spread": dict(KARA, kara_query_source="recompute"),
    "recompute-spread-page16": dict(KARA, kara_query_source="recompute", page_size=16),
    "recompute-whole-page16": dict(
        KARA, kara_query_source="recompute", kara_spread="off", page_size=16
    ),
    "recompute-whole-no-overlap": dict(
        KARA,
        kara_query_source="recompute",
        kara_spread="off",
        disable_overlap_schedule=True,
    ),
    "h2o": dict(kara_policy="h2o", kara_h2o_threshold=48, kara_h2o_budget=24),
    "snapkv-page16": dict(
        kara_policy="snapkv",
        kara_snapkv_threshold=48,
        kara_snapkv_budget=24,
        kara_snapkv_window=8,
        kara_query_source="capture",
        page_size=16,
    ),
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
