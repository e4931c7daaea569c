"""OpenMP's waiting policy for servers on a shared CPU, set before torch loads (no torch import).

GNU OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads it; its default spins idle threads
between parallel regions, so when anything else runs on the cores each of the hundreds of parallel
regions in a decode step waits for a descheduled spinner (docs/CONFIGURATION.md, "CPU defaults
and memory sizing", has the measurement). A user's own value stays.
"""

from __future__ import annotations

import os

DEFAULT_OMP_WAIT_POLICY = "PASSIVE"


def prefer_passive_omp() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it (call before torch is imported in
    the processes that compute: the launcher, whose workers fork from it, or before spawning)."""
    os.environ.setdefault("OMP_WAIT_POLICY", DEFAULT_OMP_WAIT_POLICY)
