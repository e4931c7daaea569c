"""The settings a CPU server needs, and its RAM check: the CPU serving kit's part of start-up,
applied by the launcher and ``sgl_kara.Engine`` where the server runs on a CPU.

    cpu_defaults     device cpu, torch_native attention, page size 1, float32 (SGLang's "auto"
                     turns a float32 checkpoint into float16, whose CPU matmuls fall back to
                     slow reference kernels)
    server_defaults  those plus a KV pool and request limit sized for the machine (memory.py)
    threads_bind     SGLANG_CPU_OMP_THREADS_BIND for several scheduler ranks (cores.py)
    check_memory     weights + KV pool + Kara's memory + SGLang's processes fit in RAM
"""

from __future__ import annotations

import logging
import os

from sgl_kara import env
from sgl_kara.config import KaraConfig
from sgl_kara.cpu.memory import (
    MemoryConfigError,
    check_cpu_fit,
    cpu_memory_defaults,
    plan_text,
)
from sgl_kara.memory_plan import available_ram_bytes, kara_memory, total_ram_bytes
from sgl_kara.model_shape import ModelShape
from sgl_kara.startup import (
    UnsupportedFeature,
    footprint,
    model_shape,
    observer_bytes,
)

logger = logging.getLogger(__name__)


def cpu_defaults() -> dict:
    return {
        "device": "cpu",
        "attention_backend": "torch_native",
        "page_size": 1,
        "dtype": "float32",
    }


def server_defaults(model_path: str, given: dict, compressing: bool = False) -> dict:
    """Server args the kit sets when the user did not (``given``: the ServerArgs fields the user
    set, with their values): the CPU defaults plus a KV pool and request limit sized for the
    machine (``compressing``: a compressing server, memory.py)."""
    out = {k: v for k, v in cpu_defaults().items() if k not in given}
    shape = ModelShape.from_model_path(model_path)
    itemsize = shape.itemsize(given.get("dtype") or out.get("dtype")) if shape else 4
    out.update(
        cpu_memory_defaults(shape, itemsize, total_ram_bytes(), given, compressing)
    )
    return out


def ranks_of(server_args) -> int:
    ranks = 1
    for field in ("dp_size", "tp_size", "pp_size"):
        ranks *= getattr(server_args, field, None) or 1
    return ranks


def threads_bind(server_args) -> str | None:
    """With several scheduler ranks (``--dp-size``, ``--tp-size``), set SGLang's
    ``SGLANG_CPU_OMP_THREADS_BIND`` to the physical cores split evenly over the ranks, unless
    the user set it (cores.py; SGLang refuses more ranks than NUMA nodes without it). Returns
    the value set, else None."""
    from sgl_kara.cpu._sglang import get_cpu_ids_by_node
    from sgl_kara.cpu.cores import THREADS_BIND_VAR, shared_cores, split_cores

    ranks = ranks_of(server_args)
    device = getattr(server_args, "device", None) or "cpu"
    if ranks <= 1 or device != "cpu" or os.environ.get(THREADS_BIND_VAR):
        return None
    nodes = get_cpu_ids_by_node()
    try:
        bind = split_cores(nodes, ranks)
    except ValueError as e:
        raise UnsupportedFeature(
            f"--dp-size {server_args.dp_size} x --tp-size {server_args.tp_size}: {e}; "
            f"set {THREADS_BIND_VAR} to share cores (e.g. "
            f"{THREADS_BIND_VAR}='{shared_cores(nodes, ranks)}': the ranks take the cores "
            "in turn, each slower)"
        ) from None
    if bind is not None:
        os.environ[THREADS_BIND_VAR] = bind
        logger.info(
            "sgl_kara: %s=%s (%d scheduler ranks)", THREADS_BIND_VAR, bind, ranks
        )
    return bind


def check_memory(server_args, cfg: KaraConfig) -> dict | None:
    """Refuse (UnsupportedFeature, naming the flags) weights + KV pool + capture ring + Kara's
    other memory + SGLang's processes that do not fit in the available RAM, for every rank.
    Returns the plan (None: compression off, or the model's shape or the pool size unknown)."""
    shape = model_shape(server_args)
    if not cfg.enabled or shape is None or not server_args.max_total_tokens:
        return None
    itemsize = shape.itemsize(server_args.dtype)
    pool = int(server_args.max_total_tokens)
    plan = footprint(server_args, cfg, shape, pool)
    sizes = kara_memory(shape, itemsize, plan, observer_bytes(cfg))
    rows = plan.ring_rows
    extra = sum(v for k, v in sizes.items() if k != "capture_ring")
    try:
        sizes = check_cpu_fit(
            shape,
            itemsize,
            pool,
            rows,
            cfg.query_ring_capacity,
            available_ram_bytes(),
            packed_linear=env.packed_cpu_linear(),
            max_running_requests=server_args.max_running_requests,
            ranks=ranks_of(server_args),
            kara_workspace=extra,
        )
    except MemoryConfigError as e:
        raise UnsupportedFeature(str(e)) from None
    logger.info(
        "sgl_kara memory plan: %s",
        plan_text(sizes, pool, rows, cfg.query_ring_capacity),
    )
    return sizes
