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


def machine() -> str:
    """This machine in words: cores, CPU model, memory, and the GPU if torch sees one."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem = f", {gib:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        mem = ""
    gpu = "CPU only"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{os.cpu_count()}-core {name}{mem}, {gpu}"


def stamp() -> str:
    """The line a results file carries under its command: the date and the machine it ran on."""
    import datetime

    return f"date: {datetime.date.today().isoformat()}\nmachine: {machine()}"
