"""The GPU suite as one script: every check of tests/gpu_checks.py, results to one file.

    PYTHONPATH=tests python -m bench.gpu_suite --out bench/results/gpu        # on a CUDA machine (< 10 min)
    PYTHONPATH=tests python -m bench.gpu_suite --cpu --out /tmp/gpu_suite_cpu  # here: the parts that can run

(``PYTHONPATH=tests``: tests/gpu_checks.py imports the test-support modules by name, as under pytest,
whose rootdir conftest puts tests/ on the import path.)

The plan is tests/gpu_checks.py ``plan()``: on CUDA, retention 1.0 token-identical to vanilla
SGLang (same backend, page size and CUDA-graph setting) on fa3 / FlashInfer / Triton at page 1
and 64 with decode CUDA graphs on (recompute) and on Triton page 64 with them off (capture); the
oracle after events (fa3 page 1 recompute, FlashInfer page 64 capture); a retraction storm at page
1 and 64; the kernels at Llama-3-8B serving shapes (bench/gpu_kernels.py, pool sized to the
device); peak device memory per event. 19 engine starts, < 10 minutes by construction
(``budget_seconds``, printed first). With --cpu: the same engine checks on torch_native, the
kernels under TRITON_INTERPRET=1 at tiny shapes; fa3 / FlashInfer are "not run". Each check is
recorded with its figures, ok / FAILED, and its error if it raised; the run record
(bench/record.py) goes beside the results (run.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import traceback


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="run what can run without CUDA")
    ap.add_argument("-k", default=None, help="only checks whose name contains this")
    args = ap.parse_args(argv)
    if args.cpu:
        # @triton.jit reads TRITON_INTERPRET when a kernel module is imported: import them now,
        # not later inside an engine start (which drops the variable for the engine's processes).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import sgl_kara.kernels.compact  # noqa: F401
        import sgl_kara.kernels.window_score  # noqa: F401
    import torch

    try:
        import gpu_checks as gc
    except ModuleNotFoundError as e:
        raise SystemExit(
            f"{e}: tests/gpu_checks.py is imported with tests/ on the path: "
            "PYTHONPATH=tests python -m bench.gpu_suite ..."
        ) from None
    from bench.record import RunRecord

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: run with --cpu for the parts that can run here"
        )
    os.makedirs(args.out, exist_ok=True)
    record = RunRecord(args.out, argv)
    model = gc.write_gpu_model(tempfile.mkdtemp(prefix="gpu_llama_"))
    head = {
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "mode": "cpu" if args.cpu else "cuda",
    }
    try:
        import sglang

        head["sglang"] = sglang.__version__
    except Exception:  # noqa: BLE001
        pass
    checks = gc.plan(args.cpu)
    head["engine_starts"] = sum(c[3] for c in checks)
    head["budget_s"] = round(gc.budget_seconds(checks))
    print(
        f"{len(checks)} checks, {head['engine_starts']} engine starts, bound {head['budget_s']} s",
        flush=True,
    )
    rows = []
    for name, fn, a, _, _, ok in checks:
        if args.k and args.k not in name:
            continue
        tic = time.time()
        try:
            f = getattr(gc, fn)
            if fn == "kernels":
                r = f(*a)
            elif fn == "oracle":
                r = f(model, *a, tempfile.mkdtemp())
            else:
                r = f(model, *a)
            rows.append(
                dict(
                    check=name, ok=bool(ok(r)), seconds=round(time.time() - tic, 1), **r
                )
            )
        except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
            rows.append(
                dict(
                    check=name,
                    ok=False,
                    seconds=round(time.time() - tic, 1),
                    error=f"{type(e).__name__}: {e}"[:500],
                    trace=traceback.format_exc()[-2000:],
                )
            )
        print(
            f"{'ok    ' if rows[-1]['ok'] else 'FAILED'} {name} ({rows[-1]['seconds']} s)",
            flush=True,
        )
    if args.cpu:
        rows += [
            dict(check=f"{b} backends", ok=None, note="not run: needs CUDA")
            for b in ("fa3", "flashinfer")
        ]
    with open(os.path.join(args.out, "gpu_suite.json"), "w") as f:
        json.dump({"head": head, "checks": rows}, f, indent=1, default=str)
    lines = [f"{k}: {v}" for k, v in head.items()] + [
        "",
        "| check | result | seconds | figures |",
        "|---|---|---|---|",
    ]
    for r in rows:
        figs = {
            k: v for k, v in r.items() if k not in ("check", "ok", "seconds", "trace")
        }
        res = "not run" if r["ok"] is None else ("ok" if r["ok"] else "FAILED")
        lines.append(
            f"| {r['check']} | {res} | {r.get('seconds', '-')} | {json.dumps(figs, default=str)[:300]} |"
        )
    with open(os.path.join(args.out, "gpu_suite.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    record.finish()
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
