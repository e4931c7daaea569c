"""KaraRuntime: the one owner of Kara state in a scheduler process.

It runs compression events (select requests, score their windows, pick kept entries, compact
rows), supplies logical positions and query capture to the forward hooks, and answers the
radix cache's "how much of this row is exact" question. Hooks in sgl_kara.plugin call into the
process-global ``ACTIVE`` runtime and do nothing when it is None (plain SGLang).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from sgl_kara.config import KaraConfig
from sgl_kara.mem_cache.compaction import CompactionPlan, OutOfSlots, compact_rows
from sgl_kara.policies.kara import kept_count, select
from sgl_kara.policies.snapkv import snapkv_pool, snapkv_select
from sgl_kara.policies.streaming import streaming_select
from sgl_kara.request_options import validate
from sgl_kara.scheduler.evictions import EvictionRecorder
from sgl_kara.scheduler.scoring import QueryRing, ScoringPass
from sgl_kara.scheduler.state import KaraReqState, ensure_state, get_state

logger = logging.getLogger(__name__)

ACTIVE: "KaraRuntime | None" = None

# Test/diagnostic switches (off in production): verify ownership and the protected prefix at
# every event; compare capture vs recompute scores on each request's first window.
CHECK_INTEGRITY = os.environ.get("SGL_KARA_CHECK_INTEGRITY", "0") == "1"
CROSSCHECK_QUERIES = os.environ.get("SGL_KARA_CROSSCHECK_QUERIES", "0") == "1"
# Fault injection for reliability tests: scoring raises for requests whose rid has this prefix.
MAX_CATCH_UP_PASSES = 8
FAULT_RID_PREFIX = os.environ.get("SGL_KARA_INJECT_FAULT_RID_PREFIX", "")


@dataclass
class KaraStats:
    events: int = 0
    requests_compressed: int = 0
    tokens_dropped: int = 0
    compression_seconds: float = 0.0
    recompute_fallbacks: int = 0
    skipped_no_memory: int = 0
    failed_requests: int = 0
    per_event: list = field(default_factory=list)


@dataclass
class _Job:
    """One request's part of an event: which rows, how many kept."""

    index: int  # position in the running batch
    req: object
    state: KaraReqState
    start: int  # a: first region row
    region: int  # M
    keep: int  # K
    query_start: int  # first physical row of the query window
    query_len: int


class KaraRuntime:
    def __init__(self, cfg: KaraConfig, scheduler):
        self.cfg = cfg
        self.scheduler = scheduler
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.req_to_token_pool = scheduler.req_to_token_pool
        self.kv_pool = self.allocator.get_kvcache()
        self.page_size = self.allocator.page_size
        self.model_runner = scheduler.tp_worker.model_runner
        self.layer_ids = list(range(self.kv_pool.start_layer, self.kv_pool.start_layer + self.kv_pool.layer_num))
        self.decode_steps = 0
        self.stats = KaraStats()
        self.metrics = None
        if getattr(scheduler, "enable_metrics", False) or getattr(scheduler.server_args, "enable_metrics", False):
            from sgl_kara.scheduler.metrics import KaraMetrics

            self.metrics = KaraMetrics()
        self.recorder = EvictionRecorder.from_env()  # diagnostic: evicted logical positions per event
        self.capture_now = None  # (ring rows, logical positions) of the decode forward being built
        self.scoring_pass: ScoringPass | None = None  # set only during a recompute forward
        self.ring = self._make_ring() if cfg.query_source == "capture" and cfg.query_ring_capacity else None

    def _make_ring(self) -> QueryRing:
        """The capture ring, allocated now (start-up), one row per running request; refused, naming
        the flags, when it does not fit in the memory the KV pool left."""
        from sgl_kara._sglang import RadixAttention
        from sgl_kara.memory import available_ram_bytes, gib
        from sgl_kara.support import UnsupportedFeature

        layers = {
            m.layer_id: (m.tp_q_head_num, m.qk_head_dim)
            for m in self.model_runner.model.modules() if isinstance(m, RadixAttention)
        }
        rows, capacity = int(self.scheduler.max_running_requests), self.cfg.query_ring_capacity
        device, dtype = self.req_to_token_pool.req_to_token.device, self.model_runner.dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = sum((rows + 1) * capacity * hq * d * itemsize for hq, d in layers.values())
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_ram_bytes()
        if need > 0.9 * free:
            raise UnsupportedFeature(
                f"the capture query ring needs {gib(need)} (--max-running-requests {rows} x "
                f"(--kara-window {self.cfg.window} + --kara-period {self.cfg.period}) queries x {len(layers)} "
                f"layers) but only {gib(free)} is free after the KV pool: use --kara-query-source recompute, "
                "or lower --max-running-requests / --kara-window / --kara-period / --max-total-tokens"
            )
        ring = QueryRing(layers, rows, capacity, self.req_to_token_pool.req_to_token.shape[0], dtype, device)
        logger.info("sgl_kara: capture query ring allocated: %d rows x %d queries x %d layers, %s",
                    rows, capacity, len(layers), gib(ring.nbytes))
        return ring

    # ---------------------------------------------------------------- request state
    def state_of(self, req) -> KaraReqState:
        state = get_state(req)
        if state is None:
            state = ensure_state(req)
            opts = request_options(req)
            state.enabled = opts.get("enable", True)
            state.retention = opts.get("retention")
            state.budget = opts.get("budget")
            if state.budget is not None and self.cfg.policy not in ("snapkv", "streaming"):
                from sgl_kara._sglang import FINISH_ABORT

                state.enabled = False
                req.to_finish = FINISH_ABORT(
                    f"custom_params.kara.budget applies to --kara-policy snapkv/streaming, not {self.cfg.policy}",
                    status_code=400,
                )
        return state

    def on_retract(self, req) -> None:
        """A retracted request is re-prefilled from its tokens: its KV is exact again."""
        state = get_state(req)
        if state is not None:
            enabled, retention = state.enabled, state.retention
            req.kara = KaraReqState(enabled=enabled, retention=retention)

    def insert_cap(self, req) -> int | None:
        """How much of the row the radix tree may take (None = all of it).

        A compressed row is exact only up to its protected prefix. A row re-prefilled after a
        retraction is exact, but while it runs its generated part must stay its own: inserted,
        those tokens would become a protected shared prefix that Kara never compresses again,
        and the request would hold its full length until it finishes. A finished uncompressed
        request inserts everything (later requests with the same history hit it).
        """
        state = get_state(req)
        if state is None:
            return None
        if state.compressions > 0:
            return state.protected
        if state.enabled and req.output_ids and not req.finished():
            return len(req.origin_input_ids)
        return None

    def meta(self, req) -> dict | None:
        state = get_state(req)
        if state is None:
            return None
        meta = state.meta(int(req.kv.kv_committed_len))
        if CHECK_INTEGRITY:
            meta["integrity_checks"] = state.integrity_checks
        if CROSSCHECK_QUERIES and state.crosscheck_err is not None:
            meta["query_crosscheck_max_rel_err"] = state.crosscheck_err
        return meta

    # ---------------------------------------------------------------- forward hooks
    def on_forward_batch(self, batch, fb) -> None:
        """Called after ForwardBatch.init_new: logical positions, capture indices, scoring."""
        # SGLang's runners forward a dataclasses.replace() copy of ``fb``: declared fields such
        # as positions carry over, extra attributes would not, so side data stays here.
        self.capture_now = None
        if self.scoring_pass is not None and getattr(batch, "_kara_scoring", None) is self.scoring_pass:
            fb.positions = self.scoring_pass.positions.to(fb.positions.dtype)
            return
        reqs = batch.reqs
        if not reqs or fb.forward_mode.is_idle():
            return
        offsets = [(get_state(r).pos_offset if get_state(r) is not None else 0) for r in reqs]
        if fb.forward_mode.is_decode():
            if len(reqs) != fb.batch_size:
                assert not any(offsets), "Kara offsets with extra decode rows (beam search?)"
                return
            if any(offsets):
                off = torch.tensor(offsets, dtype=fb.positions.dtype, device=fb.positions.device)
                fb.positions = fb.positions + off
            if self.ring is not None:
                self.capture_now = (self.ring.rows_for(fb.req_pool_indices.to(torch.int64)), fb.positions.to(torch.int64))
        else:
            # Only requests never compressed (or reset by retraction) are ever extended.
            assert not any(offsets), "extend of a compressed request (mixed chunk is refused)"

    def on_attention(self, layer, q, forward_batch) -> None:
        cap = self.capture_now
        if cap is not None and forward_batch.forward_mode.is_decode() and q.shape[0] == cap[0].shape[0]:
            rows, positions = cap
            self.ring.write(layer.layer_id, q.reshape(rows.shape[0], layer.tp_q_head_num, layer.qk_head_dim), rows, positions)

    # ---------------------------------------------------------------- events
    def on_decode_step(self, batch) -> None:
        """Called once per decode step, before SGLang's decode memory check."""
        if batch is None or batch.is_empty():
            return
        if self.ring is not None:
            self.ring.sweep({int(r.kv.req_pool_idx) for r in batch.reqs})
        for req in batch.reqs:
            state = self.state_of(req)
            length = int(req.kv.kv_committed_len)
            if self.ring is not None and (state.capture_from is None or not self.ring.holds(req)):
                # This step's forward writes the query of logical position length + pos_offset.
                state.capture_from = length + state.pos_offset if self.ring.assign(req) else None
            state.kv_peak = max(state.kv_peak, length)
            state.kv_sum += length
            state.kv_steps += 1
        self.decode_steps += 1
        if self.cfg.policy == "kara":
            if self.decode_steps % self.cfg.period != 0:
                return
        jobs = self._select_jobs(batch)
        passes = 0
        while jobs:
            self._run_event(batch, jobs)
            if CHECK_INTEGRITY:
                self.check_integrity(batch)
            # Catch-up: a request still holding a full window after its compression (re-prefilled
            # after a retraction, or left out by max_seqs) is compressed again in this event.
            passes += 1
            if self.cfg.policy != "kara" or passes >= MAX_CATCH_UP_PASSES:
                break
            compressed = {id(j.req) for j in jobs}
            jobs = [j for j in self._select_jobs(batch) if id(j.req) in compressed]

    def _fix_protected(self, req, state: KaraReqState, length: int) -> bool:
        """Fix P once the row reaches it; False while the row is still shorter than P."""
        if state.protected >= 0:
            return True
        p = max(int(req.kv.cache_protected_len), len(req.origin_input_ids))
        if self.page_size > 1:
            p = -(-p // self.page_size) * self.page_size
        if length < p:
            return False
        state.protected = p
        state.frontier = p
        if CHECK_INTEGRITY:
            self._snapshot_prefix(req, state)
        return True

    def _prefix_view(self, req, state):
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : state.protected].to(torch.int64).clone()
        first, last = self.layer_ids[0], self.layer_ids[-1]
        kv = [self.kv_pool.get_key_buffer(l)[slots].clone() for l in (first, last)]
        kv += [self.kv_pool.get_value_buffer(l)[slots].clone() for l in (first, last)]
        return slots, kv

    def _snapshot_prefix(self, req, state):
        state.prefix_snapshot = self._prefix_view(req, state)

    def check_integrity(self, batch) -> None:
        """Every running row: protected prefix unchanged (slots and K/V bytes); the rows' own
        slots [P, L) are referenced by exactly one row and none of them is free."""
        req_to_token = self.req_to_token_pool.req_to_token
        owned = []
        for req in batch.reqs:
            state = get_state(req)
            if state is None or state.protected < 0 or state.prefix_snapshot is None:
                continue
            slots, kv = self._prefix_view(req, state)
            ref_slots, ref_kv = state.prefix_snapshot
            if not torch.equal(slots, ref_slots):
                raise AssertionError(f"Kara integrity: protected prefix slots of {req.rid} changed: {slots.tolist()} vs {ref_slots.tolist()}")
            if not all(torch.equal(a, b) for a, b in zip(kv, ref_kv)):
                bad = [i for i, (a, b) in enumerate(zip(kv, ref_kv)) if not torch.equal(a, b)]
                rows_bad = [(a != b).flatten(1).any(1).nonzero().flatten().tolist() for a, b in zip(kv, ref_kv)]
                raise AssertionError(f"Kara integrity: protected prefix K/V bytes of {req.rid} changed (tensors {bad}, rows {rows_bad}, P={state.protected}, slots {slots.tolist()})")
            length = int(req.kv.kv_committed_len)
            owned.append(req_to_token[req.kv.req_pool_idx, state.protected : length].to(torch.int64))
            state.integrity_checks += 1
        if self.ring is not None:
            self.ring.check()
        if owned:
            own = torch.cat(owned)
            if torch.unique(own).numel() != own.numel():
                raise AssertionError("Kara integrity: a request-owned slot appears in two rows")
            free_pages = self.allocator.get_all_free_pages()
            if torch.isin(own // self.page_size, free_pages).any():
                raise AssertionError("Kara integrity: a request-owned slot is in the free list")
    def _select_jobs(self, batch) -> list[_Job]:
        cfg = self.cfg
        cands = []
        for i, req in enumerate(batch.reqs):
            state = self.state_of(req)
            if not state.enabled or req.finished() or getattr(req, "to_finish", None) is not None:
                continue
            length = int(req.kv.kv_committed_len)
            if length != int(req.kv.kv_allocated_len):
                continue
            remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
            if remaining <= 1:
                continue  # about to finish: its slots are freed anyway
            if not self._fix_protected(req, state, length):
                continue
            job = self._job_for(i, req, state, length)
            if job is not None:
                cands.append((length - state.frontier, job))
        cands.sort(key=lambda c: -c[0])  # longest uncompressed tail first
        return [job for _, job in cands[: cfg.max_seqs]]

    def _job_for(self, i, req, state, length) -> _Job | None:
        cfg = self.cfg
        if cfg.policy == "kara":
            if length - state.frontier < cfg.window:
                return None
            m = cfg.window - cfg.buffer
            retention = state.retention if state.retention is not None else cfg.retention
            keep = kept_count(m, retention)  # Token2Chunk budget is capped at keep - 1 below
            return _Job(i, req, state, state.frontier, m, keep, state.frontier, cfg.window)
        # snapkv / streaming: threshold on generated KV, compress [P, L - w) back to budget.
        # A per-request budget N (budget matching) keeps the configured gap C_max - N.
        budget = state.budget if state.budget is not None else cfg.snapkv_budget
        threshold = budget + (cfg.snapkv_threshold - cfg.snapkv_budget)
        generated = length - state.protected
        if generated <= threshold:
            return None
        m = length - cfg.snapkv_window - state.protected
        keep = max(1, budget - cfg.snapkv_window)  # the last w entries are always kept on top
        if m <= keep:
            return None
        return _Job(i, req, state, state.protected, m, keep, length - cfg.snapkv_window, cfg.snapkv_window)

    def _run_event(self, batch, jobs: list[_Job]) -> None:
        tic = time.perf_counter()
        done = dropped = 0
        # Group by (region, keep, query window) so each group has one shape.
        groups: dict[tuple, list[_Job]] = {}
        for job in jobs:
            groups.setdefault((job.region, job.keep, job.query_len), []).append(job)
        pending = list(groups.values())
        while pending:
            group = pending.pop()
            try:
                n, d = self._compress_group(batch, group)
                done, dropped = done + n, dropped + n * d
            except OutOfSlots as e:
                self.stats.skipped_no_memory += len(group)
                logger.info("Kara event skipped %d requests: %s", len(group), e)
            except Exception as e:  # noqa: BLE001 - isolate the failing request, keep serving
                if len(group) > 1:
                    pending.extend([job] for job in group)  # retry one by one to find the culprit
                else:
                    self._fail(group[0], e)
        seconds = time.perf_counter() - tic
        if done:
            self.stats.events += 1
            self.stats.compression_seconds += seconds
            if self.metrics is not None:
                self.metrics.record_event(done, dropped, seconds)
            logger.info(
                "Kara event #%d: %d requests compressed, %d KV entries freed, %.1f ms, %d free slots",
                self.stats.events, done, dropped, seconds * 1e3,
                self.allocator.available_size(),
            )

    def _fail(self, job: _Job, error: Exception) -> None:
        """Finish one request with an error; its row is untouched, so SGLang frees it as usual."""
        from sgl_kara._sglang import FINISH_ABORT

        logger.error("Kara compression failed for request %s: %s", job.req.rid, error)
        job.state.enabled = False
        self.stats.failed_requests += 1
        job.req.to_finish = FINISH_ABORT(f"KV compression failed: {error}", status_code=500)

    def _compress_group(self, batch, jobs: list[_Job]) -> tuple[int, int]:
        cfg = self.cfg
        req_to_token = self.req_to_token_pool.req_to_token
        device = req_to_token.device
        rows = torch.tensor([j.req.kv.req_pool_idx for j in jobs], dtype=torch.int64, device=device)
        M, K = jobs[0].region, jobs[0].keep
        starts = torch.tensor([j.start for j in jobs], dtype=torch.int64, device=device)
        region_slots = req_to_token[rows[:, None], starts[:, None] + torch.arange(M, device=device)].to(torch.int64)

        if cfg.policy == "streaming":
            kept = streaming_select(M, K, min(cfg.streaming_sinks, K), device=device, batch_shape=(len(jobs), len(self.layer_ids), self.kv_pool.head_num))
        else:
            scores = self._scores(batch, jobs, rows, region_slots)  # [B, L, H_kv, M]
            if cfg.policy == "kara":
                # K / M reproduces K exactly through kept_count (per-request retention too).
                kept = select(scores, K / M, min(cfg.chunk_budget, K - 1), cfg.max_chunk)
            else:
                kept = snapkv_select(snapkv_pool(scores, cfg.snapkv_kernel), K)
        plan = CompactionPlan(
            rows=rows, starts=[j.start for j in jobs], lengths=[int(j.req.kv.kv_committed_len) for j in jobs],
            region=M, kept=kept,
        )
        k_bufs = [self.kv_pool.get_key_buffer(l) for l in self.layer_ids]
        v_bufs = [self.kv_pool.get_value_buffer(l) for l in self.layer_ids]
        d = compact_rows(plan, req_to_token, k_bufs, v_bufs, self._alloc, self.allocator.free, self.page_size)
        if self.recorder is not None:
            for b, j in enumerate(jobs):
                self.recorder.record(j.req, j.state, j.start, M, kept[b], plan.lengths[b] + j.state.pos_offset)
        self._shrink(batch, jobs, d, K)
        self.stats.requests_compressed += len(jobs)
        self.stats.tokens_dropped += d * len(jobs)
        return len(jobs), d

    def _alloc(self, n: int):
        slots = self.allocator.alloc(n)
        if slots is None:
            from sgl_kara._sglang import evict_from_tree_cache

            evict_from_tree_cache(self.scheduler.tree_cache, n)
            slots = self.allocator.alloc(n)
        return slots

    def _shrink(self, batch, jobs: list[_Job], d: int, keep: int) -> None:
        idx = torch.tensor([j.index for j in jobs], dtype=torch.int64)
        for j in jobs:
            j.req.kv.kv_committed_len -= d
            j.req.kv.kv_allocated_len -= d
            j.state.pos_offset += d
            j.state.frontier = j.start + keep
            j.state.compressions += 1
        if d:
            dev_idx = idx.to(batch.seq_lens.device)
            batch.seq_lens = batch.seq_lens.clone()
            batch.seq_lens[dev_idx] -= d
            batch.orig_seq_lens = batch.orig_seq_lens.clone()
            batch.orig_seq_lens[dev_idx] -= d
            if batch.seq_lens_cpu is not None:
                batch.seq_lens_cpu = batch.seq_lens_cpu.clone()
                batch.seq_lens_cpu[idx] -= d
            batch.seq_lens_sum = None

    # ---------------------------------------------------------------- scores
    def _query_rows(self) -> slice:
        if self.cfg.policy == "kara" and self.cfg.scoring == "buffer":
            return slice(self.cfg.window - self.cfg.buffer, None)
        return slice(None)

    def _scores(self, batch, jobs, rows, region_slots) -> torch.Tensor:
        if FAULT_RID_PREFIX and any(str(j.req.rid).startswith(FAULT_RID_PREFIX) for j in jobs):
            raise RuntimeError("injected fault (SGL_KARA_INJECT_FAULT_RID_PREFIX)")
        scoring = ScoringPass(self.kv_pool, self.layer_ids, region_slots, self._query_rows())
        q_len = jobs[0].query_len
        q_starts_logical = [j.query_start + j.state.pos_offset for j in jobs]
        if self.ring is not None and all(
            j.state.capture_from is not None and s >= j.state.capture_from and self.ring.holds(j.req)
            and (int(j.req.kv.kv_committed_len) + j.state.pos_offset) - s <= self.ring.capacity
            for s, j in zip(q_starts_logical, jobs)
        ):
            starts = torch.tensor(q_starts_logical, dtype=torch.int64, device=rows.device)
            ring_rows = self.ring.rows_for(rows)
            for lid in self.layer_ids:
                scoring.score_layer(lid, self.ring.read(lid, ring_rows, starts, q_len))
            captured = scoring.result()
            if CROSSCHECK_QUERIES:
                self._crosscheck(batch, jobs, rows, region_slots, captured)
            return captured
        if self.ring is not None:
            self.stats.recompute_fallbacks += len(jobs)
            if self.metrics is not None:
                self.metrics.fallbacks.inc(len(jobs))
        self._recompute(batch, jobs, rows, scoring)
        return scoring.result()

    def _crosscheck(self, batch, jobs, rows, region_slots, captured) -> None:
        """On a request's first window both query sources must agree (the prefix is exact)."""
        first = [i for i, j in enumerate(jobs) if j.state.compressions == 0]
        if not first:
            return
        sub = [jobs[i] for i in first]
        idx = torch.tensor(first, device=rows.device)
        ref = ScoringPass(self.kv_pool, self.layer_ids, region_slots[idx], self._query_rows())
        self._recompute(batch, sub, rows[idx], ref)
        recomputed = ref.result()
        for n, i in enumerate(first):
            a, b = captured[i], recomputed[n]
            err = float(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
            jobs[i].state.crosscheck_err = err

    def _recompute(self, batch, jobs, rows, scoring: ScoringPass) -> None:
        """Extra forward over the query window tokens, reusing cached KV and writing none.

        Built as an EXTEND ScheduleBatch over the requests' real rows: prefix = rows
        [0, query_start), extend = the W window tokens (whose KV is already cached at their
        rows), positions logical. The attention hook forces save_kv_cache=False and hands each
        layer's queries to ``scoring``.
        """
        from sgl_kara._sglang import ForwardBatch, ForwardMode

        req_to_token = self.req_to_token_pool.req_to_token
        device = req_to_token.device
        W = jobs[0].query_len
        ids, positions, out_loc, prefix, seq = [], [], [], [], []
        for j in jobs:
            tokens = j.req.origin_input_ids + j.req.output_ids
            lo = j.query_start + j.state.pos_offset
            ids.extend(tokens[lo : lo + W])
            positions.extend(range(lo, lo + W))
            prefix.append(j.query_start)
            seq.append(j.query_start + W)
        row_pos = torch.tensor(prefix, device=device)[:, None] + torch.arange(W, device=device)[None, :]
        out_loc = req_to_token[rows[:, None], row_pos].reshape(-1).to(torch.int64)
        sb = copy.copy(batch)
        sb.reqs = [j.req for j in jobs]
        sb.forward_mode = ForwardMode.EXTEND
        sb.input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        sb.req_pool_indices = rows
        sb.req_pool_indices_cpu = rows.cpu()
        sb.seq_lens = torch.tensor(seq, dtype=torch.int64, device=device)
        sb.seq_lens_cpu = torch.tensor(seq, dtype=torch.int64)
        sb.orig_seq_lens = sb.seq_lens.to(torch.int32)
        sb.seq_lens_sum = int(sum(seq))
        sb.out_cache_loc = out_loc
        sb.prefix_lens = prefix
        sb.extend_lens = [W] * len(jobs)
        sb.extend_num_tokens = W * len(jobs)
        sb.extend_logprob_start_lens = [W] * len(jobs)
        sb.return_logprob = False
        sb.top_logprobs_nums = None
        sb.token_ids_logprobs = None
        sb.decoding_reqs = None
        sb.multimodal_inputs = [None] * len(jobs)
        sb.sampling_info = None
        sb.spec_info = None
        sb.input_embeds = None
        sb.extend_input_logprob_token_ids = None
        scoring.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        sb._kara_scoring = scoring
        self.scoring_pass = scoring
        try:
            fb = ForwardBatch.init_new(sb, self.model_runner, return_hidden_states_before_norm=False)
            with torch.inference_mode():
                self.model_runner.forward(fb)
        finally:
            self.scoring_pass = None


def request_options(req) -> dict:
    """``custom_params={"kara": {...}}`` of a request (already validated by the tokenizer)."""
    return validate(getattr(req.sampling_params, "custom_params", None))
