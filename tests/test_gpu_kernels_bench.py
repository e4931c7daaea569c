"""bench/gpu_kernels.py, the device check that needs no SGLang: it runs at tiny shapes under the
Triton interpreter with ``sglang`` unimportable, every kernel (and the recompute pass's attention)
checked against its reference, and its serving-shape plan fits the device and the time bound by
construction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import gpu_kernels

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


def test_serving_plan_fits_an_h100_within_five_minutes():
    """Three serving shapes (32-36 layers, 8 KV heads, head_dim 128): the pool of the largest at the
    full batch is far below an 80 GB H100's quarter, and the pessimistic time bound is < 5 min."""
    models = gpu_kernels.MODELS
    assert {m["kv_heads"] for m in models.values()} == {8} and {
        m["head_dim"] for m in models.values()
    } == {128}
    assert max(m["layers"] for m in models.values()) == 36
    biggest = max(
        gpu_kernels.pool_bytes(s, gpu_kernels.pool_slots(False, gpu_kernels.MAX_BATCH))
        for s in models.values()
    )
    assert biggest < 80e9 / 4
    assert gpu_kernels.estimate_seconds(False) < 300
    plan = gpu_kernels.plan(False)
    assert len(plan) == (6 + len(gpu_kernels.RECOMPUTE)) * len(models)
    assert all(r["bytes"] > 0 for r in plan)
