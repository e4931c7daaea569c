"""KaraRuntime: Kara in one scheduler process -- its components, wired once, the requests'
state and the admission charge. Its decode step reads top to bottom in step.py.

| stage | SGLang | Kara (where) |
|---|---|---|
| created | TokenizerManager validates the request | ``custom_params.kara`` checked, a 400 names the field (plugin ``_verify_hook``) |
| admitted | ``PrefillAdder.add_one_req`` | charged its compressed footprint (admission.py, ``charge``) |
| prefilled | extend forward | nothing: the row is exact, positions are SGLang's |
| decoding | ``update_running_batch``, every step | ``on_decode_step`` (step.py): state, statistics, ring row, device offset (forward.py) |
| scoring ahead | every step once a window's keys are decoded | ``--kara-spread even``: the planner's parts, scored by the events' scorer |
| compressed | an event when due (plan.py), before SGLang's decode memory check | scored, selected, compacted (events.py); pos_offset grows |
| retracted | ``Req.reset_for_retract`` | ``on_retract``: the row state is reset; its ring row returns at the next step |
| finished | ``release_kv_cache`` -> radix checkpoint | the tree takes the exact prefix only (mem_cache/radix.py); ``meta_info["kara"]`` (output.py) |

The components and what each owns: ``RequestTable`` (state.py) Kara's per-request state;
``ForwardContext`` (forward.py) the device offsets and the forward hooks' side data; the capture
ring (ring.py); ``Planner`` (plan.py) which windows are scored and which requests an event takes;
``Scorer`` (scoring.py) queries -> scores; ``EventRunner`` (events.py) the event transaction;
``DeviceStaging`` (staging.py) host-to-device index copies; under ``--tp-size`` the ranks'
agreement on each chunk's outcome and, with ``KARA_CHECK_TP_PLAN``, the plan digest
(tp_lockstep.py). Every SGLang object is reached through
the adapter (sgl_kara/_sglang.py, ``SchedulerParts``). The forward hooks (plugin.py) reach the
runtime of this process through ``active()``. Diagnostics are step observers
(observers.py), registered only where an environment variable asks for one
(``_register_observers``).
"""

from __future__ import annotations

import logging

from sgl_kara import _sglang as adapter
from sgl_kara import env
from sgl_kara.memory_plan import recompute_tokens
from sgl_kara.model_shape import ModelShape
from sgl_kara.policies.base import RowView
from sgl_kara.process import STATE
from sgl_kara.scheduler.events import EventRunner
from sgl_kara.scheduler.evictions import EvictionRecorder
from sgl_kara.scheduler.forward import ForwardContext
from sgl_kara.scheduler.observers import Observers
from sgl_kara.scheduler.plan import Planner
from sgl_kara.scheduler.ring import make_ring
from sgl_kara.scheduler.scoring import Scorer
from sgl_kara.scheduler.shared import StepShared
from sgl_kara.scheduler.staging import DeviceStaging
from sgl_kara.scheduler.state import KaraReqState, RequestTable
from sgl_kara.scheduler.step import decode_step
from sgl_kara.scheduler.tp_lockstep import FailureAgreement, PlanDigest
from sgl_kara.scheduler.warm_up import warm_up_kernels
from sgl_kara.vocabulary import token_pieces

logger = logging.getLogger(__name__)


def active() -> KaraRuntime | None:
    """The runtime of this scheduler process (None: plain SGLang, the hooks stay inert)."""
    return STATE.runtime


def activate(runtime: KaraRuntime | None) -> None:
    STATE.runtime = runtime


def state_of(req) -> KaraReqState | None:
    """Kara's state of ``req`` in this process (None: no runtime, or not seen by it)."""
    runtime = STATE.runtime
    return None if runtime is None else runtime.table.get(req)


class KaraRuntime:
    # KARA_CHECK_TP_PLAN under --tp-size > 1 (tp_lockstep.PlanDigest; set in __init__)
    plan_check: PlanDigest | None = None

    def __init__(self, cfg, scheduler, server_args):
        """The wiring: each part built from what it uses, in the order they need each other."""
        self.cfg, self.decode_steps = cfg, 0
        policy = self.policy = _policy(cfg, server_args)
        self.table = RequestTable(policy)
        parts = self.parts = adapter.SchedulerParts.of(
            scheduler, server_args, recompute_tokens
        )
        device = parts.req_to_token.device
        observers = self.observers = Observers()  # filled last: _register_observers
        shared = _shared(policy, parts, observers)
        self.backend, self.stats = shared.backend, shared.stats
        self.metrics, self.staging, self.check = (
            shared.metrics,
            shared.staging,
            shared.check,
        )
        self.ring = _ring(parts, cfg, policy, self.check)
        self.forward = _forward_context(shared, self.ring, self.table)
        # SGLang's attention observers (patches/upstream 0006) where it has them, else the
        # plugin's attention hook calls the forward context (plugin.py)
        self.remove_observer = self.backend.observe_attention(self.forward)
        self.planner = Planner(policy, cfg, parts, observers.protected)
        heads = _kv_heads(scheduler, parts)
        self.scorer = Scorer(
            shared, self.forward, self.ring, self._count_fallbacks, heads
        )
        self.plan_check = PlanDigest.from_env(*_ranks(parts))
        recorder = EvictionRecorder.from_env(*_ranks(parts)[:2], heads[0])
        self.events = EventRunner(
            shared,
            self.scorer,
            self.forward,
            recorder,
            _agreement(parts),
            in_flight=self.planner.in_flight,
        )
        self._register_observers()
        if device.type == "cuda":
            self._warm_up()

    def _register_observers(self) -> None:
        """The diagnostics the environment asks for, as step observers (none in
        production): the one place the runtime reaches sgl_kara/diagnostics."""
        from sgl_kara.diagnostics import observers_from_env

        self.observers.extend(observers_from_env(self))

    def _warm_up(self) -> None:
        """Compile every kernel an event launches, and build the pool's pointer tables."""
        from sgl_kara.kernels.compact import pointer_table

        parts = self.parts
        heads = [parts.q_heads]
        warm_up_kernels(
            parts.keys,
            parts.layer_ids,
            self.policy,
            heads,
            parts.dtype,
            parts.page_size,
        )
        for get in (parts.keys, parts.values):
            bufs = [get(layer_id) for layer_id in parts.layer_ids]
            pointer_table(bufs)

    # ------------------------------------------------------------------ request state
    def state_of(self, req) -> KaraReqState:
        """The request's state, created (from its ``custom_params.kara``) when first seen."""
        return self.table.state_of(req)

    def on_retract(self, req) -> None:
        """A retracted request is re-prefilled from its tokens: its KV is exact again."""
        state = self.table.get(req)
        if state is not None:
            state.reset_row()

    def meta(self, req) -> dict | None:
        state = self.table.get(req)
        if state is None:
            return None
        meta = state.meta(adapter.kv_length(req))
        self.observers.meta(state, meta)
        return meta

    # ------------------------------------------------------------------ admission
    @property
    def slack(self) -> int:
        """Rows admission charges beyond the policy's growth for a capped spread (the planner's)."""
        return self.planner.slack

    def charge(self, req, running: bool) -> int | None:
        """The ``max_new_tokens`` admission presents for ``req`` (admission.py): its output so
        far plus what its KV may still grow by (``schedule.growth``) beyond what it holds -- a
        running request its row now, a request being admitted the row its prefill leaves (its
        prompt, nothing compressible yet: the same charge it keeps while it runs, so the memory
        admission counts for it does not shrink once it runs, which would leave room no
        admission pass sees until a request leaves); with a capped spread, the rows it may leave
        uncompressed on top. None: compression off for it (SGLang's own count)."""
        state = self.state_of(req)
        if not state.enabled:
            return None
        done = adapter.output_length(req)
        remaining = max(0, adapter.max_new_tokens(req) - done)
        if remaining <= 0:
            return done
        if running:
            row = RowView(
                state.protected,
                state.frontier,
                adapter.kv_length(req),
                state.pos_offset,
                state,
            )
        else:
            row = RowView(-1, 0, 0, 0, state)
        return done + min(
            remaining, self.policy.schedule.growth(remaining, row) + self.slack
        )

    # ------------------------------------------------------------------ decode steps
    def on_decode_step(self, batch) -> None:
        """Called once per decode step, before SGLang's decode memory check (step.py)."""
        decode_step(self, batch)

    def _count_fallbacks(self, windows: int) -> None:
        self.stats.recompute_fallbacks += windows
        if self.metrics is not None:
            self.metrics.fallbacks.inc(windows)


# ---------------------------------------------------------------------- the wiring's parts
def _policy(cfg, server_args):
    """The configured policy, given the model's vocabulary where it reads token text (its
    tokenizer was checked at start-up, startup.py)."""
    policy = cfg.make_policy()
    if policy.needs_tokens:
        policy.bind_vocabulary(
            token_pieces(
                adapter.server_arg(server_args, "model_path"),
                adapter.server_arg(server_args, "revision"),
            )
        )
    return policy


def _shared(policy, parts, observers) -> StepShared:
    staging = DeviceStaging(parts.req_to_token.device, observers)
    return StepShared(
        policy,
        parts,
        staging,
        observers=observers,
        metrics=_metrics(parts),
        check=env.check_integrity(),
    )


def _ranks(parts) -> tuple:
    """(this rank, the ranks, their group) under tensor parallelism."""
    return parts.tp_rank, parts.tp_size, parts.tp_group


def _metrics(parts):
    """Kara's Prometheus counters where SGLang exports metrics, on one rank as SGLang's own."""
    if not (parts.metrics and parts.tp_rank == 0):
        return None
    from sgl_kara.scheduler.metrics import KaraMetrics

    return KaraMetrics()


def _ring(parts, cfg, policy, poison: bool):
    """The capture ring where queries are captured and the policy reads any (None else)."""
    capacity = policy.schedule.query_capacity()
    if cfg.query_source != "capture" or not capacity:
        return None
    return make_ring(parts, cfg, capacity, poison=poison)


def _forward_context(shared, ring, table) -> ForwardContext:
    parts = shared.parts
    return ForwardContext(
        shared.policy,
        ring,
        parts.req_to_token,
        parts.keys,
        parts.layer_ids[0],
        table,
        offsets=shared.backend.position_offsets(parts),
        heads=(parts.q_heads, parts.head_dim),
    )


def _kv_heads(scheduler, parts) -> tuple[int, int]:
    """(this rank's first KV head, the model's KV heads). Tensor parallelism: each rank scores
    and compacts its own heads, the model's [first, first + H_kv): SGLang splits them evenly, or
    with fewer heads than ranks gives rank r head r * heads // ranks (replicated: refused for
    policies that score from attention, startup.replicated_kv_heads)."""
    model_heads = ModelShape.from_config(adapter.model_hf_config(scheduler)).kv_heads
    return parts.tp_rank * model_heads // parts.tp_size, model_heads


def _agreement(parts):
    """The ranks' agreement on each chunk's outcome under --tp-size > 1 (None: one rank)."""
    return FailureAgreement(*_ranks(parts)) if parts.tp_size > 1 else None
