"""What every part of a decode step reads and none of them owns, built once by the runtime and
handed to the scorer and the event runner whole (instead of a parameter each)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_kara import backends
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.staging import DeviceStaging


@dataclass
class KaraStats:
    events: int = 0
    requests_compressed: int = 0
    tokens_dropped: int = 0
    compression_seconds: float = 0.0
    recompute_fallbacks: int = 0
    skipped_no_memory: int = 0
    deferred_events: int = 0  # trigger=pressure / headroom: due events not run
    failed_requests: int = 0
    # CUDA: most device memory an event allocated above its start
    event_peak_bytes: int = 0
    # --kara-spread: window queries scored ahead of their events
    spread_queries: int = 0
    # ... and the time it took (part of compression_seconds)
    spread_seconds: float = 0.0
    event_max_seconds: float = 0.0  # the longest Kara work in one decode step
    # KARA_CHECK_TP_PLAN: gathers at which every rank's digest agreed
    tp_plan_checks: int = 0


@dataclass
class StepShared:
    """``policy``: the compression policy; ``parts``: SGLang's pools and the scheduler's
    settings (_sglang.SchedulerParts); ``staging``: host-to-device index copies; ``stats`` /
    ``metrics``: the counters (metrics None: not exported here); ``observers``: the step
    observers (none in production); ``backend``: this process's SGLang backend (backends);
    ``check``: the kernels verify slot values (KARA_CHECK_INTEGRITY)."""

    policy: object
    parts: object
    staging: DeviceStaging
    stats: KaraStats = field(default_factory=KaraStats)
    observers: Observers = field(default_factory=Observers)
    backend: backends.Backend = field(default_factory=backends.current)
    metrics: object = None
    check: bool = False
