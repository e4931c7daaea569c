"""bench/gpu_kernels.py, the device check that needs no SGLang: it runs at tiny shapes under the
Triton interpreter with ``sglang`` unimportable, every kernel (and the recompute pass's attention)
checked against its reference, and its serving-shape plan fits the device and the time bound by
construction."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench import gpu_kernels
from sgl_kara.scheduler import spread

ROOT = Path(__file__).resolve().parents[1]

BLOCK_SGLANG = """
import runpy, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"{name} is blocked: the device check must not need SGLang")
sys.meta_path.insert(0, Blocker())
sys.modules["sglang"] = None
sys.argv = ["gpu_kernels.py", "--small", "--out", sys.argv[1]]
try:
    runpy.run_path(%r, run_name="__main__")
except SystemExit as e:
    assert not any(m.startswith("sglang.") for m in sys.modules), "a module of sglang was imported"
    raise
"""


def test_runs_without_sglang_every_kernel_exact_or_within_tolerance(tmp_path):
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(ROOT),
        "CUDA_VISIBLE_DEVICES": "",
    }
    code = BLOCK_SGLANG % str(ROOT / "bench" / "gpu_kernels.py")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert result["head"]["sglang_imported"] is False
    rows = result["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {
        "kara window scores",
        "kara window scores, a spread part",
        "kara window scores, fp16 queries / bf16 keys",
        "snapkv scores",
        "compact_kv",
        "copy_slots disjoint",
        "copy_slots staged",
        *(
            gpu_kernels.recompute_kernel(*shape)
            for shape in gpu_kernels.SMALL_RECOMPUTE
        ),
    } <= kernels, kernels
    assert all(r["ok"] is not False for r in rows), rows
    assert all(r["rel_err"] <= r["tol"] for r in rows if "rel_err" in r)
    assert (tmp_path / "gpu_kernels.md").read_text().count("| tiny-gqa |") == len(rows)


# The serving shapes docs/TESTING.md names, from the models' published configs: layers, query
# heads, KV heads, head dim.
PUBLISHED = {
    "Llama-3-8B": (32, 32, 8, 128),
    "Qwen3-8B": (36, 32, 8, 128),
    "Qwen3-0.6B": (28, 16, 8, 128),
}
# One rank of a tensor-parallel model: Qwen3-8B (36 layers, 32 query / 8 KV heads) and
# Llama-3-70B (80 layers, 64 / 8) at TP 2 and 8; at TP 8 each rank holds one KV head.
RANKS = {
    "Qwen3-8B TP2": (36, 16, 4, 128),
    "Qwen3-8B TP8": (36, 4, 1, 128),
    "Llama-3-70B TP2": (80, 32, 4, 128),
    "Llama-3-70B TP8": (80, 8, 1, 128),
}


def test_serving_plan_fits_an_h100_within_five_minutes():
    """The serving shapes are the published models' and their tensor-parallel ranks'; at the
    full batch, the pool of each (K and V of every layer, bf16, for every slot the plan touches:
    each request's largest region, its kept entries and two tails) is below an 80 GB H100's
    quarter; the plan has one row per shape and kernel, each row's compulsory bytes what the
    kernel must move; and the pessimistic time bound is under the documented 5 minutes."""
    shapes = {
        name: (s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"])
        for name, s in gpu_kernels.SHAPES.items()
    }
    assert shapes == {**PUBLISHED, **RANKS}
    b = gpu_kernels.MAX_BATCH
    w, m, k = gpu_kernels.kara_shape(False)
    o = gpu_kernels.KARA
    kept = math.ceil(o["retention"] * (o["window"] - o["buffer"]))  # r of the W - U
    assert (w, m, k) == (o["window"], o["window"] - o["buffer"], kept)
    snap = gpu_kernels.SNAPKV
    region = max(m, snap["threshold"] + 1 - snap["window"])
    slots = 16 + b * (region + k + 2 * gpu_kernels.TAIL)
    for name, (layers, _, kv_heads, head_dim) in {**PUBLISHED, **RANKS}.items():
        pool = 2 * layers * slots * kv_heads * head_dim * 2
        assert gpu_kernels.pool_bytes(gpu_kernels.SHAPES[name], slots) == pool
        assert gpu_kernels.pool_slots(False, b) >= slots
        assert pool < 80e9 / 4, (name, pool)
    plan = gpu_kernels.plan(False)
    kernels = {
        "kara window scores",
        "kara window scores, a spread part",
        "kara window scores, fp16 queries / bf16 keys",
        "snapkv scores",
        "compact_kv",
        "copy_slots disjoint",
        "copy_slots staged",
        *(gpu_kernels.recompute_kernel(*shape) for shape in gpu_kernels.RECOMPUTE),
    }
    rows = {(r["model"], r["kernel"]): r for r in plan}
    assert len(rows) == len(plan) and set(rows) == {
        (name, kernel) for name in {**PUBLISHED, **RANKS} for kernel in kernels
    }
    # spread parts: CUDA's part size, 32-query parts (the CPU's) and 256-query parts recomputed
    assert gpu_kernels.part_size(False) == spread.PART_SIZE["cuda"] == 256
    parts = {n for _, n, _ in gpu_kernels.RECOMPUTE if n < o["window"]}
    assert parts == {spread.PART_SIZE["cpu"], spread.PART_SIZE["cuda"]}
    for name, (layers, q_heads, kv_heads, head_dim) in {**PUBLISHED, **RANKS}.items():
        slot = kv_heads * head_dim * 2  # one layer's K (or V) of a slot, bf16
        # scores read the W queries (every query head) and the M region keys
        assert rows[name, "kara window scores"]["bytes"] == b * (
            w * q_heads * head_dim * 2 + m * slot
        )
        # a spread part reads its 256 queries and the same region keys
        assert rows[name, "kara window scores, a spread part"]["bytes"] == b * (
            256 * q_heads * head_dim * 2 + m * slot
        )
        # compaction reads and writes K and V of the kept entries on every layer
        assert rows[name, "compact_kv"]["bytes"] == 2 * 2 * layers * b * k * slot
    assert gpu_kernels.estimate_seconds(False) < 300
