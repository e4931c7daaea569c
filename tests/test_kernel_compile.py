"""Every Triton kernel of sgl_kara compiled to a cubin for sm_80 (A100) and sm_90 (H100), on a
machine without a GPU.

The kernels are not compiled from a hand-written signature: the real launchers run
(``scheduler/warm_up.py``'s start-up warm-up for Kara and SnapKV, then the launches
``bench/gpu_kernels.py`` makes at its serving shapes) on ``meta`` tensors, with each kernel's
``kernel[grid](...)`` turned into ``JITFunction.warmup``: Triton's own binder derives the
signature, the constexprs and the integer / pointer specialisations from the arguments the
launcher passes, exactly as on a GPU, and ``triton.compile`` runs every stage (TTIR, TTGIR,
LLVM IR, PTX, and the cubin through the ``ptxas`` Triton's wheel ships) for a fake driver whose
target is ``GPUTarget("cuda", 80 | 90, 32)``. So a launcher and its kernel cannot disagree
(argument count, dtype, constexpr) without this failing, and the bf16 / fp16 ``tl.dot`` branch
of the scoring kernels, which the Triton interpreter never takes (it widens bf16 to fp32), is
compiled and must lower to tensor-core MMAs on that dtype.

Matrix: fp16 and bf16 models (queries and pool in the model's dtype), head dims 64 / 128 / 256
(``bench/gpu_kernels.py``'s shapes at 128 -- three models on one GPU, and one rank of Qwen3-8B and
Llama-3-70B at TP 2 and 8: 16 / 32 query heads over 4 KV heads, 4 / 8 over one -- plus a 64 and a
256 shape), whole windows and spread parts of ``PART_SIZE["cuda"]`` queries, the mixed
fp16-query / bf16-pool scores at bench's shapes (head dim 128: the fp32-dot branch, whose compile
is the slowest), compaction of every model's layer count, slot copies both disjoint and staged.
fp32 models, fp8 pools and the mixed scores at head dims 64 / 256 are left out (the one-minute
budget of the default suite on two cores). The kernels compiled for bench's bf16 launches are
the ones ``specialisations()`` of bench/gpu_kernels.py counts for its time bound. One worker
process per target, both at once, each with a fresh Triton cache (nothing carried between runs).
A worker is ``python tests/test_kernel_compile.py --arch 90 --out FILE``. Every ``@triton.jit`` function of
``sgl_kara.kernels`` must be reached by some launch: a kernel added without a launcher in the
matrix fails the test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")
HEAD_DIMS = (64, 128, 256)
# Shapes beside bench/gpu_kernels.py's (all head_dim 128): one per other head dim.
EXTRA_MODELS = {
    "Llama-3.2-1B": dict(layers=16, q_heads=32, kv_heads=8, head_dim=64),
    "Gemma-2-9B": dict(layers=42, q_heads=16, kv_heads=8, head_dim=256),
}
# Shared memory a block may use (opt-in maximum): A100 163 KiB, H100 227 KiB (CUDA C
# Programming Guide, "Technical Specifications per Compute Capability").
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
WORKER_TIMEOUT_S = 300


# ------------------------------------------------------------------------------- the worker
def _models() -> dict:
    from bench import gpu_kernels

    return {**gpu_kernels.SHAPES, **EXTRA_MODELS}


def _launch_matrix(case: list) -> list[dict]:
    """Run every launcher at every shape of the matrix (meta tensors); returns the errors."""
    import torch

    from bench import gpu_kernels as gk
    from sgl_kara.kernels.compact import compact_kv, copy_slots
    from sgl_kara.kernels.window_score import window_scores_paged
    from sgl_kara.policies.kara import KaraOptions, KaraPolicy
    from sgl_kara.policies.snapkv import SnapKVOptions, SnapKVPolicy
    from sgl_kara.scheduler.warm_up import warm_up_kernels

    dev, b = "meta", gk.MAX_BATCH
    w, m, k = gk.kara_shape(False)
    part = gk.part_size(False)
    sw, sm, _ = gk.snapkv_shape(False)
    slots = gk.pool_slots(False, b)
    errors = []

    def run(label, fn, *args, **kwargs):
        case[:] = [label]
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every failure of the matrix is reported
            errors.append(dict(case=label, error=f"{type(e).__name__}: {e}"[:3000]))

    def ints(*shape):
        return torch.empty(shape, dtype=torch.int64, device=dev)

    for name, s in _models().items():
        L, hq, hkv, d = s["layers"], s["q_heads"], s["kv_heads"], s["head_dim"]
        for dtype in (torch.float16, torch.bfloat16):
            tag = f"{name} {str(dtype).split('.')[-1]}"
            kb = [torch.empty(slots, hkv, d, dtype=dtype, device=dev) for _ in range(L)]
            vb = [torch.empty_like(t) for t in kb]
            pool = type("Pool", (), {"get_key_buffer": lambda self, i, kb=kb: kb[i]})()
            kara = KaraPolicy(KaraOptions(**gk.KARA))
            snap = SnapKVPolicy(SnapKVOptions(**gk.SNAPKV))
            for policy in (kara, snap):
                run(
                    f"{tag} warm-up {policy.name}",
                    warm_up_kernels,
                    pool.get_key_buffer,
                    list(range(L)),
                    policy,
                    [hq],
                    dtype,
                    page_size=64,
                )
            # bench's mixed case (fp16 queries, bf16 pool: a --kv-cache-dtype) at its shapes
            mixed = dtype == torch.bfloat16 and name in gk.SHAPES
            for qd in (dtype, torch.float16) if mixed else (dtype,):
                for qw, qm in ((w, m), (part, m), (sw, sm)):
                    run(
                        f"{tag} scores q {str(qd).split('.')[-1]} W={qw} M={qm}",
                        window_scores_paged,
                        torch.empty(b, qw, hq, d, dtype=qd, device=dev),
                        kb[0],
                        ints(b, qm),
                        use_triton=True,
                    )
            run(
                f"{tag} compact_kv",
                compact_kv,
                kb,
                vb,
                ints(b, L, hkv, k),
                ints(b, k),
                use_triton=True,
                check=False,
            )
            for disjoint in (True, False):
                run(
                    f"{tag} copy_slots disjoint={disjoint}",
                    copy_slots,
                    kb,
                    vb,
                    ints(b * gk.TAIL),
                    ints(b * gk.TAIL),
                    use_triton=True,
                    disjoint=disjoint,
                )
    return errors


def _ptx_mma_types(ptx: str) -> list[str]:
    """Operand types of the tensor-core instructions in ``ptx`` (mma.sync / wgmma)."""
    found = set()
    for op in re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\.\S+", ptx):
        found |= {t for t in ("bf16", "f16", "tf32", "f32") if f".{t}." in op + "."}
    return sorted(found)


def worker(arch: int, out: str) -> None:
    """Compile the matrix for ``GPUTarget("cuda", arch, 32)`` and write what came out."""
    import torch  # noqa: F401  (before triton: the launchers' tensors)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import sgl_kara.kernels

    class TargetOnly:
        """The part of Triton's driver the JIT asks before it compiles (no launch follows)."""

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return f"sm_{arch}"

        def get_current_stream(self, device=None):
            return 0

    compiled: dict[str, dict] = {}
    case: list[str] = [""]

    class Compile:
        """``kernel[grid](*args, **meta)`` -> compile what that launch would run."""

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tic = time.perf_counter()
                ck = self.fn.warmup(*args, grid=grid, **kwargs)
                entry = compiled.setdefault(
                    ck.hash, dict(seconds=round(time.perf_counter() - tic, 2))
                )
                entry.setdefault("cases", []).append(case[0])
                if "kernel" in entry:
                    return
                names = self.fn.arg_names
                entry.update(
                    kernel=self.fn.__name__,
                    signature=dict(ck.src.signature),
                    constexprs={
                        names[p[0]]: repr(v) for p, v in ck.src.constants.items()
                    },
                    target=[ck.metadata.target.backend, ck.metadata.target.arch],
                    stages={s: len(ck.asm.get(s) or b"") for s in STAGES},
                    ptx_target=re.findall(r"^\.target\s+(\S+)", ck.asm["ptx"], re.M),
                    mma=_ptx_mma_types(ck.asm["ptx"]),
                    shared=ck.metadata.shared,
                    num_warps=ck.metadata.num_warps,
                )

            return launch

    kernels = []
    for info in pkgutil.iter_modules(sgl_kara.kernels.__path__):
        mod = importlib.import_module(f"sgl_kara.kernels.{info.name}")
        if hasattr(mod, "want_triton"):
            # The launchers take the Triton path on meta tensors (their dispatch asks for CUDA).
            mod.want_triton = lambda *a, **k: True
        for name, v in list(vars(mod).items()):
            if isinstance(v, JITFunction):
                kernels.append(name)
                setattr(mod, name, Compile(v))
    driver.set_active(TargetOnly())
    tic = time.perf_counter()
    errors = _launch_matrix(case)
    result = dict(
        arch=arch,
        triton=triton.__version__,
        kernels=sorted(kernels),
        compiled=list(compiled.values()),
        errors=errors,
        seconds=round(time.perf_counter() - tic, 1),
    )
    Path(out).write_text(json.dumps(result, indent=1))


# -------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[int, dict]:
    """Both targets compiled at once, one worker process each, each with an empty cache."""
    tmp = tmp_path_factory.mktemp("kernel_compile")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    procs = {}
    for arch in ARCHS:
        env_a = {**env, "TRITON_CACHE_DIR": str(tmp / f"cache_{arch}")}
        out = tmp / f"sm_{arch}.json"
        cmd = [sys.executable, __file__, "--arch", str(arch), "--out", str(out)]
        procs[arch] = (
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env_a,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
            out,
        )
    results, logs = {}, {}
    try:
        for arch, (proc, _) in procs.items():
            logs[arch], _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for arch, (proc, out) in procs.items():
        log = logs[arch][-5000:]
        assert proc.returncode == 0, f"sm_{arch} worker failed:\n{log}"
        results[arch] = json.loads(out.read_text())
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_every_launch_compiles_to_a_cubin(compiled, arch):
    r = compiled[arch]
    assert not r["errors"], "\n\n".join(
        f"{e['case']}: {e['error']}" for e in r["errors"]
    )
    # Every @triton.jit kernel of sgl_kara.kernels was reached by some launcher.
    assert r["kernels"] and {c["kernel"] for c in r["compiled"]} == set(r["kernels"])
    for c in r["compiled"]:
        what = f"{c['kernel']} {c['constexprs']} ({c['cases'][0]})"
        assert c["target"] == ["cuda", arch], what
        assert all(c["stages"][s] > 0 for s in STAGES), (what, c["stages"])
        assert c["ptx_target"] and c["ptx_target"][0].startswith(f"sm_{arch}"), what
        assert c["shared"] <= SMEM_LIMIT[arch], (what, c["shared"])


def _scores(r, fp32_dot: bool) -> dict:
    """{(query dtype, D): {kernel: mma operand types}} of the scoring kernels."""
    out: dict = {}
    for c in r["compiled"]:
        if c["kernel"] in ("_lse_kernel", "_colsum_kernel"):
            if c["constexprs"]["FP32_DOT"] == repr(fp32_dot):
                key = (c["signature"]["q_ptr"], int(c["constexprs"]["D"]))
                out.setdefault(key, {})[c["kernel"]] = c["mma"]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_scores_use_tensor_cores_on_their_dtype(compiled, arch):
    """The branch a GPU runs for bf16 / fp16 models (never the interpreter's): both scoring
    passes at each head dim, lowered to MMAs on the model's dtype."""
    scores = _scores(compiled[arch], fp32_dot=False)
    want = {(p, d) for p in ("*fp16", "*bf16") for d in HEAD_DIMS}
    assert want <= set(scores), sorted(scores)
    for (ptr, d), by_kernel in scores.items():
        assert set(by_kernel) == {"_lse_kernel", "_colsum_kernel"}, (ptr, d)
        for kernel, mma in by_kernel.items():
            assert {"*fp16": "f16", "*bf16": "bf16"}[ptr] in mma, (kernel, ptr, d, mma)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_dtype_scores_take_the_exact_fp32_dot(compiled, arch):
    """fp16 queries against a bf16 pool: both widened to fp32, no half-precision MMA."""
    scores = _scores(compiled[arch], fp32_dot=True)
    assert ("*fp16", 128) in scores, sorted(scores)
    for by_kernel in scores.values():
        assert not any({"bf16", "f16"} & set(m) for m in by_kernel.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_bench_time_bound_counts_every_compile(compiled, arch):
    """bench/gpu_kernels.py bounds its run by the kernels it compiles (``specialisations``, from
    Triton's rules restated): exactly the ones Triton compiled here for its bf16 shapes."""
    from bench import gpu_kernels as gk

    tags = tuple(f"{name} bfloat16 " for name in gk.SHAPES)
    bench = [
        c
        for c in compiled[arch]["compiled"]
        if any(case.startswith(tags) for case in c["cases"])
    ]
    assert len(bench) == len(gk.specialisations(gk.SHAPES.values())), sorted(
        (c["kernel"], str(c["constexprs"])) for c in bench
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_data_movement_kernels_cover_every_head_dim(compiled, arch):
    moved = {
        (c["kernel"], c["constexprs"].get("D"), c["constexprs"].get("BLOCK"))
        for c in compiled[arch]["compiled"]
        if c["kernel"] not in ("_lse_kernel", "_colsum_kernel")
    }
    assert {("_compact_kernel", str(d), None) for d in HEAD_DIMS} <= moved, moved
    for kernel in ("_copy_rows_kernel", "_gather_rows_kernel", "_scatter_rows_kernel"):
        assert any(k == kernel for k, _, _ in moved), kernel


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="compile the kernel matrix for one target")
    ap.add_argument("--arch", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    worker(a.arch, a.out)
