"""KaraScheduler: SGLang's Scheduler with Kara's runtime, prefill adder and output streamer.

Its decode-step work and /server_info entry: where SGLang has the subclass points
``pre_decode_step`` / ``extra_internal_state`` (patches/upstream 0004) they are overridden here,
else the plugin hooks ``Scheduler.update_running_batch`` and ``get_internal_state`` (plugin.py)
-- one mechanism per SGLang, never both.

``run_kara_scheduler_process`` is the module-level process function handed to SGLang's
Engine / HTTP server (``run_scheduler_process_func``; processes are spawned, so it must be
importable by name). It installs KaraScheduler as the Scheduler class of that scheduler process
only, through SGLang's plugin mechanism (a class REPLACE hook: ``run_scheduler_process`` loads
plugins first "so hooks can override Scheduler"), then runs SGLang's own process function
(patches/scheduler.md).
"""

from __future__ import annotations

import dataclasses
import logging

from sgl_kara import backends
from sgl_kara._sglang import Scheduler
from sgl_kara.config import KaraConfig
from sgl_kara.scheduler import runtime
from sgl_kara.scheduler.admission import make_prefill_adder
from sgl_kara.scheduler.output import make_output_streamer
from sgl_kara.startup import check_runtime_supported

logger = logging.getLogger(__name__)


class KaraScheduler(Scheduler):
    kara_config: KaraConfig = KaraConfig()

    def __init__(self, server_args, port_args, *args, **kwargs):
        super().__init__(server_args, port_args, *args, **kwargs)
        check_runtime_supported(self, self.kara_config)
        self.kara = runtime.KaraRuntime(self.kara_config, self, server_args)
        runtime.activate(self.kara)
        logger.info("sgl_kara: compression active, %s", self.kara_config)

    def get_output_streamer_class(self):
        return make_output_streamer(
            super().get_output_streamer_class(), not backends.current().hooked
        )

    def get_prefill_adder_class(self):
        return make_prefill_adder(
            super().get_prefill_adder_class(),
            self.kara.charge,
            self.kara.backend.asks_admission,
        )

    # SGLang's subclass points where it has them (never called by an SGLang without them, whose
    # scheduler is hooked instead: plugin.serving_hooks)
    def pre_decode_step(self, batch) -> None:
        self.kara.on_decode_step(batch)

    def extra_internal_state(self) -> dict:
        out = super().extra_internal_state()
        out["kara"] = replica_stats(self.kara)
        return out


def replica_stats(runtime) -> dict:
    """A runtime's Kara counters, its DP rank and its KV pool: free slots, slots the radix
    tree holds but may evict, and the pool's size (free == pool once idle and flushed: nothing
    leaked); and the counters of the diagnostics asked for (its step observers': none in
    production)."""
    from sgl_kara import _sglang as adapter
    from sgl_kara.process import STATE

    parts = runtime.parts
    return {
        **dataclasses.asdict(runtime.stats),
        **runtime.observers.stats(),
        "dp_rank": adapter.dp_rank(),
        "decode_steps": runtime.decode_steps,
        "free_slots": parts.available(),
        "evictable_slots": parts.evictable(),
        "pool_slots": parts.pool_tokens,
        # the backend chosen at start-up (backends): each touch point served by SGLang's
        # extension point or by sgl_kara's hook, and the hooks this scheduler process registered
        "backend": runtime.backend.name,
        "touch_points": runtime.backend.touch_points(),
        "hooks": list(STATE.hooks),
        # recompute forwards: built and run by SGLang (patches/upstream 0008) or by sgl_kara
        "recompute_forwards": dict(runtime.scorer.forwards),
    }


def run_kara_scheduler_process(*args, kara_config: dict, **kwargs):
    from sgl_kara import _sglang as adapter
    from sgl_kara.process import STATE

    KaraScheduler.kara_config = KaraConfig.build(**kara_config)
    # This scheduler process only; applied now (SGLang applies the other plugins' hooks after its
    # plugins load, at the start of run_scheduler_process, and a method hook on Scheduler then
    # lands on KaraScheduler, which calls SGLang's through super()).
    adapter.register_hook(
        adapter.TARGET_SCHEDULER, KaraScheduler, adapter.HookType.REPLACE
    )
    STATE.hooks.append(
        adapter.TARGET_SCHEDULER
    )  # SGLang has no other way in (patches/)
    adapter.apply_hooks()
    try:
        return adapter.run_scheduler_process(*args, **kwargs)
    finally:
        STATE.shutdown()  # SGLang's event loop has ended: close the trace file


__all__ = ["KaraScheduler", "run_kara_scheduler_process"]
