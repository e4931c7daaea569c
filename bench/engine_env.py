"""The process environment a benchmark engine starts under (shared by quality.py and throughput.py)."""

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
