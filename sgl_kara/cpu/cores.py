"""CPU cores per scheduler rank: the ``SGLANG_CPU_OMP_THREADS_BIND`` value for several ranks.

On CPU each SGLang scheduler rank binds its OpenMP threads to one group of cores. Unset, SGLang
gives each rank a whole NUMA node and refuses more ranks (``--dp-size x --tp-size x --pp-size``)
than nodes, so ``--dp-size 2`` does not start on a one-node machine. ``split_cores`` splits the
physical cores evenly into one contiguous group per rank (``"0|1"`` on 2 cores, ``"0-7|8-15"``
on 16). No SGLang import: the caller passes SGLang's per-node core lists.
"""

from __future__ import annotations

THREADS_BIND_VAR = "SGLANG_CPU_OMP_THREADS_BIND"


def parse_cpu_list(text: str) -> list[int]:
    """``"0,2,4-6"`` -> [0, 2, 4, 5, 6] (the lscpu / SGLang list form)."""
    cpus = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``: runs of consecutive ids as ranges."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def shared_cores(node_cpus: list[str], ranks: int) -> str:
    """A bind value for more ranks than cores: rank r on core r mod cores (``"0|1|0|1"`` for 4
    ranks on 2 cores)."""
    cores = [c for n in node_cpus for c in parse_cpu_list(n)]
    return "|".join(str(cores[r % len(cores)]) for r in range(ranks))


def split_cores(node_cpus: list[str], ranks: int) -> str | None:
    """The bind value for ``ranks`` ranks over the cores of ``node_cpus`` (one list per NUMA
    node, in node order, as SGLang's ``get_cpu_ids_by_node`` returns them).

    None when SGLang's own default serves: one rank, or no more ranks than nodes (each rank gets
    a node). Otherwise the cores, in node order, are cut into ``ranks`` contiguous groups whose
    sizes differ by at most one (the first ``cores % ranks`` groups get the extra core). Raises
    ValueError when there are fewer cores than ranks: a rank needs a core of its own.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    nodes = [parse_cpu_list(n) for n in node_cpus]
    nodes = [n for n in nodes if n]
    if ranks == 1 or ranks <= len(nodes):
        return None
    cores = [c for n in nodes for c in n]
    if len(cores) < ranks:
        raise ValueError(
            f"{ranks} scheduler ranks need a CPU core each, but this process may use "
            f"{len(cores)} ({format_cpu_list(cores) or 'none'})"
        )
    base, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        size = base + (1 if rank < extra else 0)
        groups.append(format_cpu_list(cores[start : start + size]))
        start += size
    return "|".join(groups)
