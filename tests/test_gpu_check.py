"""bench/gpu_check.py, the first-GPU check: at tiny shapes under the Triton interpreter with
``sglang`` unimportable it runs every section and every check passes (what needs CUDA reported as
skipped); its full run is bounded within eight minutes on an H100 by construction, at the
published models' per-rank shapes; its free list is SGLang's allocators' (checked against them);
its near-tie rule is sound (no error within its bound changes a kept set it calls safe); every
Triton kernel of sgl_kara is launched; its device table names the right figures."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_kernels

# Benchmarks, not the product: the integration tier (docs/TESTING.md, tiers).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

BLOCK_SGLANG = """
import runpy, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"{name} is blocked: the first-GPU check must not need SGLang")
sys.meta_path.insert(0, Blocker())
sys.modules["sglang"] = None
sys.argv = ["gpu_check", "--small", "--out", sys.argv[1]]
try:
    runpy.run_module("bench.gpu_check", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not any(m.startswith("sglang.") for m in sys.modules), "a module of sglang was imported"
    raise
"""

# What needs CUDA, by section (skipped on a CPU); everything else runs and must pass.
NEEDS_CUDA = {
    "staging": 2,
    "step": len(gpu_check.STEP_RUNS) * len(gpu_check.PAGE_SIZES),
    "bandwidth": 1,
}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(ROOT),
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_SGLANG, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out


def test_small_run_without_sglang_passes_every_section(small_run):
    proc, out = small_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["head"]["sglang_imported"] is False
    assert data["passed"] is True
    results = data["results"]
    assert set(data["sections"]) == set(gpu_check.SECTIONS)
    for name in gpu_check.SECTIONS:
        mine = [r for r in results if r["section"] == name]
        assert mine, name
        assert not [r for r in mine if r["status"] == "fail"], mine
        skipped = [r for r in mine if r["status"] == "skipped"]
        assert len(skipped) == NEEDS_CUDA.get(name, 0), (name, skipped)
        assert all(r["decision"].startswith("skipped: needs CUDA") for r in skipped)
        assert data["sections"][name]["pass"] == sum(
            r["status"] == "pass" for r in mine
        )
    # every check of every shape ran: kernels (window scores int64 / int32 in both pools,
    # compaction and both copies in both pools) at each per-rank shape, the int32 refusal once,
    # spread's splits and select's three checks per shape, both page sizes of the step
    n = len(gpu_check.shapes(True))
    counts = {
        name: sum(r["section"] == name and r["status"] == "pass" for r in results)
        for name in gpu_check.SECTIONS
    }
    assert counts["kernels"] == 10 * n + 1
    assert counts["spread"] == len(gpu_check.SMALL_SPLITS) * n
    assert counts["select"] == 3 * n
    assert counts["step"] == len(gpu_check.PAGE_SIZES)
    shapes = {r["shape"] for r in results if r["section"] == "kernels"}
    assert shapes == {
        gpu_check.shape_name(m, tp, s) for m, tp, s in gpu_check.shapes(True)
    }
    # every decision printed as it came
    for r in results:
        assert f"[{r['section']}] {r['status'].upper()}: {r['check']}" in proc.stdout
    # the spread's parts and select's rows: figures within their tolerances, rows judged
    for r in results:
        f = r["figures"]
        if r["section"] == "spread":
            assert f["rel_err_whole"] <= gpu_check.SPREAD_TOL
        if r["check"].endswith("against float64 scores"):
            assert 0 < f["stable_rows"] == f["exact_stable"] <= f["rows"]


def test_small_run_writes_the_markdown_table(small_run):
    proc, out = small_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "gpu_check.json").read_text())
    text = (out / "gpu_check.md").read_text()
    header = "| section | check | shape | result | figures | decision |"
    assert header in text
    rows = text.split(header, 1)[1].strip().splitlines()[1:]
    assert len(rows) == len(data["results"])
    for row, r in zip(rows, data["results"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == r["section"] and cells[3] == r["status"], row
    assert (out / "run.json").exists()


# Published configs: layers, query heads, KV heads, head dim; one rank holds q / tp query heads
# and max(1, kv / tp) KV heads.
PER_RANK = {
    ("Qwen3-8B", 1): (36, 32, 8, 128),
    ("Qwen3-8B", 2): (36, 16, 4, 128),
    ("Qwen3-8B", 8): (36, 4, 1, 128),
    ("Llama-3-70B", 1): (80, 64, 8, 128),
    ("Llama-3-70B", 2): (80, 32, 4, 128),
    ("Llama-3-70B", 8): (80, 8, 1, 128),
}


def test_full_run_is_bounded_within_eight_minutes_on_an_h100():
    """The serving shapes are the published models' ranks at TP 1, 2 and 8; the pools fit an
    80 GB H100 (the pool-end case: K and V of two layers of 400,000 slots at 8 KV heads x 128 x
    bf16, 0.8 GB a buffer; the ordinary pool of every layer); the pessimistic bound is at most
    eight minutes, and the run's budget guard no larger."""
    got = {
        (m, tp): (s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"])
        for m, tp, s in gpu_check.shapes(False)
    }
    assert got == PER_RANK
    assert gpu_check.kara_shape(False) == (512, 480, 120)
    assert gpu_check.part_size(False) == 256
    assert all(sum(s) == 512 for s in gpu_check.SPLITS)
    buffer = 400_000 * 8 * 128 * 2
    assert 0.8e9 < buffer < 0.85e9
    assert (
        gpu_check.end_pool_slots(gpu_check.shapes(False)[0][2], False, None) == 400_000
    )
    assert 2 * gpu_check.END_LAYERS * buffer < 80e9 / 4
    # a device with less memory gets a smaller pool-end pool: a quarter of what is free
    assert gpu_check.end_pool_slots(gpu_check.shapes(False)[0][2], False, 8e9) == int(
        8e9 / 4 / (4 * 8 * 128 * 2)
    )
    for (_, _), (layers, _, kv, d) in PER_RANK.items():
        ordinary = (
            2 * layers * gpu_check.pool_slots(False, gpu_check.BATCH) * kv * d * 2
        )
        assert ordinary < 80e9 / 4
    estimate = gpu_check.estimate_seconds(False)
    assert estimate <= 8 * 60, estimate
    assert gpu_check.BUDGET_S <= 8 * 60
    # the compile count it charges covers the kernels of every shape, int32 and int64 slots
    keys = gpu_kernels.specialisations(
        [s for *_, s in gpu_check.shapes(False)],
        score_dtypes=(("bf16", "bf16"),),
        slot_dtypes=("int64", "int32"),
    )
    assert estimate > gpu_kernels.EST_START_S + len(keys) * gpu_kernels.EST_COMPILE_S


def test_every_triton_kernel_is_launched(monkeypatch, tmp_path):
    """One shape's checks (tiny, interpreted) launch every ``@triton.jit`` kernel of
    sgl_kara.kernels (found by scanning the package, not from a list; under the interpreter
    ``triton.jit`` makes an ``InterpretedFunction``)."""
    from kernel_launches import Launches
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import sgl_kara.kernels

    kernels = set()
    for info in pkgutil.iter_modules(sgl_kara.kernels.__path__):
        mod = importlib.import_module(f"sgl_kara.kernels.{info.name}")
        kernels |= {
            n
            for n, v in vars(mod).items()
            if isinstance(v, (JITFunction, InterpretedFunction))
        }
    launches = Launches(monkeypatch)
    ctx = gpu_check.Context(small=True, cuda=False, budget_s=600)
    rep = gpu_check.Report(str(tmp_path), {})
    model, tp, spec = gpu_check.shapes(True)[-1]
    gpu_check.check_shape(rep, ctx, model, tp, spec, first=True)
    assert {r["status"] for r in rep.results} == {"pass"}, rep.results
    assert kernels and {name for name, *_ in launches.take()} == kernels


@pytest.mark.parametrize("page", [1, 16])
def test_free_list_is_sglangs(page):
    """The check's free list hands out and takes back pages as SGLang 0.5.23's allocators do
    (TokenToKVPoolAllocator at page size 1, PagedTokenToKVPoolAllocator above): the same slots
    for the same calls, the same free list after every call."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    size = 64 * page
    if page == 1:
        theirs = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, False)
    else:
        theirs = PagedTokenToKVPoolAllocator(
            size, page, torch.bfloat16, "cpu", None, False
        )
    mine = gpu_check.FreeList(theirs.free_pages.clone(), page)
    taken = []
    for n_pages in (3, 1, 5, 2):
        a, b = theirs.alloc(n_pages * page), mine.alloc(n_pages * page)
        assert torch.equal(a, b)
        taken.append(b)
        assert torch.equal(theirs.free_pages, mine.free_pages)
    for got in (taken[2], taken[0]):
        pages = got[::page] // page
        theirs.free_page_ids(pages)
        mine.free_page_ids(pages)
        assert torch.equal(theirs.free_pages, mine.free_pages)
    assert torch.equal(theirs.alloc(4 * page), mine.alloc(4 * page))
    assert mine.alloc(1000 * page) is None and theirs.alloc(1000 * page) is None
    assert mine.available_size() == theirs.available_size()


def test_rows_called_far_from_ties_keep_their_sets_under_any_error_within_the_bound():
    """``near_tie_free``'s rows keep exactly the same top-K and Kara selection for scores moved
    by up to eps each (random moves, the extremes included); and a row with a tie at the K-th
    score is not called safe."""
    from sgl_kara.policies.kara import select

    g = torch.Generator().manual_seed(0)
    m, k, alpha, gamma = 56, 14, 7, 4
    ref = torch.rand(400, m, generator=g, dtype=torch.float64) * torch.rand(
        400, 1, generator=g, dtype=torch.float64
    )
    eps = torch.full((400,), 1e-3, dtype=torch.float64)
    topk, kara = gpu_check.near_tie_free(ref, eps, k, alpha, gamma)
    assert 0 < int(topk.sum()) < 400 and 0 < int(kara.sum()) < 400
    for trial in range(20):
        if trial < 2:
            noise = (
                eps[:, None]
                * (1 if trial == 0 else -1)
                * torch.sign(torch.randn(400, m, generator=g, dtype=torch.float64))
            )
        else:
            noise = (
                torch.rand(400, m, generator=g, dtype=torch.float64) * 2 - 1
            ) * eps[:, None]
        moved = ref + noise
        for chunk, safe in ((0, topk), (alpha, kara)):
            same = (
                select(moved, k / m, chunk, gamma) == select(ref, k / m, chunk, gamma)
            ).all(dim=1)
            assert bool(same[safe].all()), (trial, chunk)
    tied = ref[:1].clone()
    order = tied[0].argsort(descending=True)
    tied[0, order[k]] = tied[0, order[k - 1]]
    t, kk = gpu_check.near_tie_free(tied, eps[:1], k, alpha, gamma)
    assert not bool(t[0]) and not bool(kk[0])
    # Token2Chunk near a tie, every score far from one: the top K0 = 7 at even positions 0-12
    # (six chunks of one interior each, R = the sum of the ends), the third and fourth R 1e-4
    # apart; the other scores 0.3 apart below them, the interiors lowest (the fill takes none).
    # Moving four scores by eps swaps the chunks.
    row = torch.zeros(1, m, dtype=torch.float64)
    top = {0: 100.0, 2: 50.0, 4: 60.0, 6: 55.0, 8: 54.9999, 10: 45.0, 12: 30.0}
    rest = sorted((p for p in range(m) if p not in top), key=lambda p: p < 12)
    for p, v in top.items():
        row[0, p] = v
    for j, p in enumerate(rest):
        row[0, p] = 20 - 0.3 * j
    t, kk = gpu_check.near_tie_free(row, eps[:1], k, alpha, gamma)
    assert bool(t[0]) and not bool(kk[0])
    moved = row.clone()
    moved[0, [2, 4]] -= 1e-3
    moved[0, [6, 8]] += 1e-3
    assert not torch.equal(
        select(row, k / m, alpha, gamma), select(moved, k / m, alpha, gamma)
    )
    assert torch.equal(select(row, k / m, 0, gamma), select(moved, k / m, 0, gamma))


@pytest.mark.parametrize(
    "name, tb_s",
    [
        ("NVIDIA H100 80GB HBM3", 3.35),
        ("NVIDIA H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", 3.9),
        ("NVIDIA H200", 4.8),
        ("NVIDIA GH200 480GB", 4.0),
        ("NVIDIA A100-SXM4-80GB", 2.039),
        ("NVIDIA A100-SXM4-40GB", 1.555),
        ("NVIDIA A100 80GB PCIe", 1.935),
        ("NVIDIA L40S", 0.864),
        ("NVIDIA L4", 0.3),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_nominal_bandwidth_by_device_name(name, tb_s):
    found = gpu_check.nominal(name)
    assert (found and found[0]) == (tb_s and pytest.approx(tb_s * 1e12))
