"""Tensor parallelism on a CPU: the two start-up changes SGLang 0.5.23 needs to run
``--tp-size N`` on a machine without CUDA (patches/cpu_parallel.md), registered by the plugin
in every process without CUDA, plain SGLang included (the ``parallel`` part, cpu/hooks.py):

    model_parallel_group  no PyNccl communicator for a gloo group: ``init_model_parallel_group``
                          builds one unless asked not to (its default is "not NPU / XPU"),
                          and PyNccl needs a CUDA device; the ranks all-reduce over gloo
    threads_binding       SGLang gives each rank a whole NUMA node and asserts ranks <= nodes
                          when ``SGLANG_CPU_OMP_THREADS_BIND`` is unset; unset here, the
                          physical cores are split among the ranks (cores.split_cores). Where
                          SGLang does not bind the threads itself (its CPU kernels' AMX or
                          arm64 path, absent from PyPI's sgl-kernel), this rank's process is
                          pinned to its cores and torch uses that many threads, so ranks do not
                          oversubscribe the cores

A user's ``SGLANG_CPU_OMP_THREADS_BIND`` is kept as given (SGLang's own rules then apply).
"""

from __future__ import annotations

import logging
import os

from sgl_kara.cpu.cores import THREADS_BIND_VAR, parse_cpu_list, split_cores

logger = logging.getLogger(__name__)


def model_parallel_group_hook(
    original, group_ranks, local_rank, backend, use_pynccl=None, *args, **kwargs
):
    """AROUND ``parallel_state.init_model_parallel_group``: a gloo group (the CPU's) whose
    caller left ``use_pynccl`` to SGLang's default gets no PyNccl communicator."""
    if use_pynccl is None and backend == "gloo":
        use_pynccl = False
    return original(group_ranks, local_rank, backend, use_pynccl, *args, **kwargs)


def default_bind(world_size: int) -> str | None:
    """The ``SGLANG_CPU_OMP_THREADS_BIND`` value for ``world_size`` ranks on this machine's
    cores (cores.split_cores; None: SGLang's own default serves, one NUMA node per rank, or
    there are fewer cores than ranks, which SGLang then refuses with its own message)."""
    from sgl_kara.cpu._sglang import get_cpu_ids_by_node

    try:
        return split_cores(get_cpu_ids_by_node(), world_size)
    except ValueError:
        return None


def threads_binding_hook(original, *, numa_index, world_size):
    """AROUND ``numa_utils.init_threads_binding``: with ``SGLANG_CPU_OMP_THREADS_BIND`` unset
    and more ranks than NUMA nodes, set it in this process to the cores split among the ranks;
    then SGLang's own reading. Returns SGLang's: this rank's cores (``"0-3"``)."""
    if not os.environ.get(THREADS_BIND_VAR):
        bind = default_bind(world_size)
        if bind is not None:
            os.environ[THREADS_BIND_VAR] = bind
            logger.info(
                "sgl_kara: %s=%s (%d ranks)", THREADS_BIND_VAR, bind, world_size
            )
    cores = original(numa_index=numa_index, world_size=world_size)
    if world_size > 1 and not sglang_binds_threads():
        pin(cores)
    return cores


def sglang_binds_threads() -> bool:
    """Does SGLang bind this rank's OpenMP threads itself (its CPU kernels' path)?"""
    from sgl_kara.cpu._sglang import parallel_bootstrap

    return bool(
        parallel_bootstrap._is_cpu_amx_available or parallel_bootstrap._is_cpu_arm64
    )


def pin(cores: str) -> None:
    """This process on ``cores`` (a cpu list), torch with one thread per core."""
    import torch

    cpus = set(parse_cpu_list(cores))
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # a container may forbid it: the thread count still applies
        logger.warning("sgl_kara: could not pin this rank to cores %s: %s", cores, e)
    torch.set_num_threads(len(cpus))
