"""What a benchmark engine starts under: its process environment, and the extra sgl_kara options
a command line gives every compressing system (``--kara-opt NAME=VALUE``). Shared by bench.quality
and bench.engine_run / bench.throughput_grid."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def engine_env(omp_threads: int, **extra: str):
    """Environment for starting an engine (its subprocesses inherit it); restored on exit.

    Drops TRITON_INTERPRET (engines run real kernels), sets ``extra`` variables, and with
    ``omp_threads > 0`` pins OMP_NUM_THREADS with OMP_WAIT_POLICY=PASSIVE: spinning OpenMP
    workers make a tiny model's steps several times slower whenever anything else runs on the
    cores (bench/RESULTS.md); passive single-threaded workers keep the step cost stable."""
    saved = dict(os.environ)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(extra)
    if omp_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(omp_threads)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_engine(model_path: str, omp_threads: int, **opts):
    """An ``sgl_kara.Engine`` as the accuracy harnesses run it: greedy-ready (seed 0), SGLang's
    logs at errors only, the overlap scheduler off (a logit processor's step index needs it)."""
    import sgl_kara

    with engine_env(omp_threads):
        return sgl_kara.Engine(
            model_path=model_path,
            log_level="error",
            random_seed=0,
            disable_overlap_schedule=True,
            **opts,
        )


def parse_value(text: str):
    """A ``--kara-opt`` value: int, float, or the string itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def kara_opts(items: list[str] | None) -> dict:
    """``--kara-opt NAME=VALUE`` items as sgl_kara.Engine keywords (``kara_NAME``; dashes or
    underscores, with or without the ``kara`` prefix). sgl_kara validates them when the engine
    starts, as it does the flags."""
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--kara-opt takes NAME=VALUE (got {item!r})")
        out["kara_" + name.replace("-", "_").removeprefix("kara_")] = parse_value(value)
    return out
