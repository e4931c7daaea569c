"""KaraRuntime: the one owner of Kara state in a scheduler process, and the request lifecycle.

| stage | SGLang | Kara (where) |
|---|---|---|
| created | TokenizerManager validates the request | ``custom_params.kara`` checked, a 400 names the field (plugin ``_verify_hook``) |
| admitted | ``PrefillAdder.add_one_req`` | charged its compressed footprint, ``policy.footprint`` (admission.py) |
| prefilled | extend forward | nothing: the row is exact, positions are SGLang's |
| decoding | ``update_running_batch``, every step | ``on_decode_step``: state, stats, ring row, device offset (forward.py) |
| compressed | an event for the requests due at this step (``jobs.due_at``: ``policy.due`` of the request's own generated-token count, or of the scheduler's step with ``--kara-phase server``; ``--kara-trigger pressure / headroom``: and memory binds, pressure.py), before SGLang's decode memory check | P fixed, regions planned (jobs.py), scored / selected / compacted (events.py); pos_offset grows |
| retracted | ``Req.reset_for_retract`` | ``on_retract``: ``state.reset_row()``; its ring row returns at the next step |
| re-prefilled | extend forward | exact again; the radix tree takes its prompt only (mem_cache/radix.py); its windows are compressed again promptly (catch-up) |
| finished | ``release_kv_cache`` -> radix checkpoint | the tree takes the exact prefix only; ``meta_info["kara"]`` (output.py) |

The forward hooks (plugin.py) reach the runtime of this process through ``active()``; everything
they need per forward is in ``self.forward`` (forward.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from sgl_kara import env
from sgl_kara.policies import base as policy_base
from sgl_kara.policies.base import RowView
from sgl_kara.process import STATE
from sgl_kara.request_options import check_supported, validate
from sgl_kara.scheduler.checks import RuntimeChecks
from sgl_kara.scheduler.events import EventRunner
from sgl_kara.scheduler.evictions import EvictionRecorder
from sgl_kara.scheduler.forward import ForwardContext
from sgl_kara.scheduler.jobs import decoded_tokens, due_at, overdue, plan_jobs
from sgl_kara.scheduler.pressure import DEFERRING, growth_within, horizon, memory_binds
from sgl_kara.scheduler.ring import make_ring
from sgl_kara.scheduler.spread import plan_chunks, slack, spreads
from sgl_kara.scheduler.state import KaraReqState, get_state
from sgl_kara.scheduler.warm_up import query_heads, warm_up_kernels

logger = logging.getLogger(__name__)

MAX_CATCH_UP_PASSES = 8
# trigger=pressure / headroom: a deferred backlog (several windows per request) is compressed
# while memory binds, at most this many windows per request in one event.
MAX_PRESSURE_PASSES = 64


def active() -> KaraRuntime | None:
    """The runtime of this scheduler process (None: plain SGLang, the hooks stay inert)."""
    return STATE.runtime


def activate(runtime: KaraRuntime | None) -> None:
    STATE.runtime = runtime


@dataclass
class KaraStats:
    events: int = 0
    requests_compressed: int = 0
    tokens_dropped: int = 0
    compression_seconds: float = 0.0
    recompute_fallbacks: int = 0
    skipped_no_memory: int = 0
    deferred_events: int = (
        0  # trigger=pressure / headroom: due events not run (memory did not bind)
    )
    failed_requests: int = 0
    event_peak_bytes: int = (
        0  # CUDA: most device memory an event allocated above its start
    )
    spread_queries: int = (
        0  # --kara-spread: window queries scored ahead of their events
    )
    spread_seconds: float = (
        0.0  # ... and the time it took (part of compression_seconds)
    )
    event_max_seconds: float = (
        0.0  # the longest event work in one decode step (spread steps included)
    )


class KaraRuntime(RuntimeChecks):
    def __init__(self, cfg, scheduler):
        self.cfg = cfg
        self.policy = cfg.make_policy()
        self.scheduler = scheduler
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.req_to_token_pool = scheduler.req_to_token_pool
        self.kv_pool = self.allocator.get_kvcache()
        self.page_size = self.allocator.page_size
        self.model_runner = scheduler.tp_worker.model_runner
        self.layer_ids = list(
            range(
                self.kv_pool.start_layer,
                self.kv_pool.start_layer + self.kv_pool.layer_num,
            )
        )
        self.decode_steps = 0
        self.stats = KaraStats()
        self.metrics = None
        if getattr(scheduler, "enable_metrics", False) or getattr(
            scheduler.server_args, "enable_metrics", False
        ):
            from sgl_kara.scheduler.metrics import KaraMetrics

            self.metrics = KaraMetrics()
        self.check = env.check_integrity()
        self.recorder = (
            EvictionRecorder.from_env()
        )  # diagnostic: evicted logical positions per event
        capacity = self.policy.query_capacity()
        self.ring = (
            make_ring(self, capacity)
            if cfg.query_source == "capture" and capacity
            else None
        )
        self.forward = ForwardContext(
            self.policy, self.ring, self.req_to_token_pool.req_to_token, self.kv_pool
        )
        self.events = EventRunner(self)
        self.spreading = spreads(self.policy, cfg.spread)
        self.slack = (
            slack(self.policy, cfg.spread_max) if self.spreading else 0
        )  # charged by admission too
        # SGLang's overlap scheduler on CUDA: the previous batch's forward may still run on its
        # stream while this step is planned (see _fence).
        self.forward_stream = None
        if (
            getattr(scheduler, "enable_overlap", False)
            and self.req_to_token_pool.req_to_token.device.type == "cuda"
        ):
            self.forward_stream = (
                getattr(scheduler, "forward_stream", None)
                or self.model_runner.forward_stream
            )
        chunk = getattr(scheduler.server_args, "chunked_prefill_size", None)
        self.recompute_tokens = (
            chunk if chunk and chunk > 0 else 8192
        )  # tokens per recompute forward
        if self.req_to_token_pool.req_to_token.device.type == "cuda":
            warm_up_kernels(
                self.kv_pool,
                self.layer_ids,
                self.policy,
                query_heads(self.model_runner.model),
                self.model_runner.dtype,
                self.page_size,
            )

    # ---------------------------------------------------------------- request state
    def state_of(self, req) -> KaraReqState:
        state = get_state(req)
        if state is None:
            opts = validate(getattr(req.sampling_params, "custom_params", None))
            state = req.kara = KaraReqState(
                enabled=opts.get("enable", True),
                retention=opts.get("retention"),
                budget=opts.get("budget"),
            )
            for name in ("retention", "budget"):
                if (
                    opts.get(name) is not None
                    and name not in self.policy.request_options
                ):
                    self._refuse_option(req, state, name)
            try:  # also checked in the tokenizer (plugin); a request that got here anyway is aborted
                check_supported(req.sampling_params, self.policy.name)
            except ValueError as e:
                from sgl_kara._sglang import FINISH_ABORT

                state.enabled = False
                req.to_finish = FINISH_ABORT(str(e), status_code=400)
        return state

    def _refuse_option(self, req, state, name: str) -> None:
        from sgl_kara._sglang import FINISH_ABORT

        accepting = [
            p.name for p in policy_base.policies() if name in p.request_options
        ]
        state.enabled = False
        req.to_finish = FINISH_ABORT(
            f"custom_params.kara.{name} applies to --kara-policy {'/'.join(accepting)}, not {self.policy.name}",
            status_code=400,
        )

    def on_retract(self, req) -> None:
        """A retracted request is re-prefilled from its tokens: its KV is exact again."""
        state = get_state(req)
        if state is not None:
            state.reset_row()

    def meta(self, req) -> dict | None:
        state = get_state(req)
        if state is None:
            return None
        meta = state.meta(int(req.kv.kv_committed_len))
        if self.check:
            meta["integrity_checks"] = state.integrity_checks
        if env.crosscheck_queries() and state.crosscheck_err is not None:
            meta["query_crosscheck_max_rel_err"] = state.crosscheck_err
        return meta

    # ---------------------------------------------------------------- decode steps and events
    def on_decode_step(self, batch) -> None:
        """Called once per decode step, before SGLang's decode memory check."""
        if batch is None or batch.is_empty():
            return
        if self.ring is not None:
            self.ring.sweep({int(r.kv.req_pool_idx) for r in batch.reqs})
        for req in batch.reqs:
            state = self.state_of(req)
            length = int(req.kv.kv_committed_len)
            self.forward.sync_offset(req, state)
            if self.ring is not None and (
                state.capture_from is None or not self.ring.holds(req)
            ):
                # This step's forward writes the query of logical position length + pos_offset.
                state.capture_from = (
                    length + state.pos_offset if self.ring.assign(req) else None
                )
            state.kv_peak = max(state.kv_peak, length)
            if state.protected >= 0:
                state.tail_peak = max(state.tail_peak, length - state.frontier)
            state.kv_sum += length
            state.kv_steps += 1
        self.decode_steps += 1
        tic = time.perf_counter()
        try:
            if self._step(batch):
                # Freed slots admit waiting requests at once: SGLang's prefill otherwise skips
                # admission while the running batch is marked full, until a request ends.
                batch.batch_is_full = False
        finally:
            self.stats.event_max_seconds = max(
                self.stats.event_max_seconds, time.perf_counter() - tic
            )

    def _step(self, batch) -> int:
        """This decode step's compression work: spread scoring, then the due events. Returns the
        KV slots freed."""
        phase, step = self.cfg.phase, self.decode_steps
        if self.spreading:
            chunks = plan_chunks(
                self.policy,
                batch.reqs,
                self.state_of,
                self.page_size,
                self.cfg.spread_max,
                lambda r: step if phase == "server" else decoded_tokens(r, r.kara),
                on_protected=self._snapshot_prefix if self.check else None,
            )
            if chunks:
                self._fence()
                self.events.advance(batch, chunks)
        if phase == "server" and not self.policy.due(step):
            return 0

        def due(req) -> bool:
            return due_at(self.policy, phase, step, req)

        jobs = self._ready(self._plan(batch.reqs, due))
        deferring = self.cfg.trigger in DEFERRING
        if jobs and deferring and not self.memory_binds(batch, jobs):
            self.stats.deferred_events += 1
            if self.metrics is not None:
                self.metrics.deferred.inc()
            return 0
        passes = freed = 0
        while jobs:
            self._fence()
            freed += self.events.run(batch, jobs)
            if self.check:
                self.check_integrity(batch)
            # Catch-up: a request still due after its compression (re-prefilled after a retraction,
            # left out by max_seqs, or a backlog deferred under trigger=pressure / headroom) is compressed
            # again in this event.
            passes += 1
            if passes >= (MAX_PRESSURE_PASSES if deferring else MAX_CATCH_UP_PASSES):
                break
            compressed = {id(j.req) for j in jobs}
            jobs = [j for j in self._plan(batch.reqs, due) if id(j.req) in compressed]
            if jobs and deferring and not self.memory_binds(batch, jobs):
                break
        return freed

    def _ready(self, jobs):
        """Due jobs an event takes now. A spread window still being scored waits for a later due
        step (its scores then complete: spread.deadline), unless its tail would outgrow what
        admission charged it; a window with no spread job (a backlog after a retraction, a job
        dropped) is scored whole now."""
        if not self.spreading:
            return jobs
        out = []
        for j in jobs:
            s = j.state.scoring
            if s is not None and s.covers(j.region) and s.remaining > 0:
                row = RowView(
                    j.state.protected,
                    j.state.frontier,
                    int(j.req.kv.kv_committed_len),
                    j.state.pos_offset,
                    j.state,
                )
                charge = self.policy.tail_charge(row)
                tail = row.length - row.frontier
                if not overdue(
                    tail,
                    None if charge is None else charge + self.slack,
                    self.policy.event_interval(),
                ):
                    continue
            out.append(j)
        return out

    def _fence(self) -> None:
        """Under SGLang's overlap scheduler on CUDA the previous batch's forward may still run on
        the forward stream while this step is planned, reading the rows and slots an event
        rewrites and writing the ring / observer state it reads: order this step's event work
        after it on the device (stream order, as SGLang's own WAR barrier does; the host does
        not wait). The next forward waits for this stream (SGLang's run_batch)."""
        if self.forward_stream is not None:
            torch.cuda.current_stream().wait_stream(self.forward_stream)

    def memory_binds(self, batch, jobs) -> bool:
        """trigger=pressure / headroom: are the slots these jobs free needed (pressure.py)?"""
        sched = self.scheduler
        remaining = [
            r.sampling_params.max_new_tokens - decoded_tokens(r, self.state_of(r))
            for r in batch.reqs
        ]
        growth = growth_within(
            remaining,
            horizon(self.cfg.trigger, self.policy.event_interval()),
            self.page_size,
        )
        fresh = sum(j.fresh_slots(self.page_size) for j in jobs)
        return memory_binds(
            self.free_slots(),
            growth,
            fresh,
            len(sched.waiting_queue),
            len(batch.reqs),
            int(sched.max_running_requests),
        )

    def _plan(self, reqs, due):
        return plan_jobs(
            self.policy,
            reqs,
            self.state_of,
            self.page_size,
            self.cfg.max_seqs,
            on_protected=self._snapshot_prefix if self.check else None,
            due=due,
            slack=self.slack,
        )

    def footprint(self, remaining: int, state) -> int:
        """Tokens a request that may still generate ``remaining`` will hold (admission): the
        policy's footprint plus the rows a capped spread may leave uncompressed."""
        if remaining <= 0:
            return remaining
        return min(remaining, self.policy.footprint(remaining, state) + self.slack)

    def free_slots(self) -> int:
        """Slots an allocation can get now: free, plus what ``alloc_slots`` may evict from the tree."""
        return int(self.allocator.available_size()) + int(
            self.scheduler.tree_cache.evictable_size()
        )

    def alloc_slots(self, n: int):
        """The allocator's ``alloc``, evicting from the radix tree once when the pool is short."""
        slots = self.allocator.alloc(n)
        if slots is None:
            from sgl_kara._sglang import evict_from_tree_cache

            evict_from_tree_cache(self.scheduler.tree_cache, n)
            slots = self.allocator.alloc(n)
        return slots
