"""Running one compression event over planned jobs: score, select, compact, shrink.

Jobs are grouped by region shape (one batched score / select / compaction per group). A group
that fails is retried request by request so the failing request is found; that request finishes
with an error (HTTP 500) and its row is left untouched (SGLang frees it as usual); the others are
compressed. Before a group is scored, its jobs are fitted to the pool: compaction allocates
fresh slots before it frees the old ones, so a job whose fresh slots the pool (free + evictable)
cannot give now is skipped *unscored* -- scoring it would be wasted, and on a full pool a
threshold policy's due request would otherwise be scored again at every step (51,344 wasted
scorings in one SnapKV run before this rule). A group that still cannot get its slots is skipped
(OutOfSlots: nothing changed).

    score    ScoringPass over the policy's query window: captured queries for the jobs whose
             window is still in the ring, a recompute forward (paper App. C.2) for the others
             (no ring row, or queries gone); or the policy's own scores when it needs no queries
    select   policy.select(scores [B, L, H_kv, M], K) -> kept [B, L, H_kv, K]
    compact  mem_cache.compaction: kept entries and the shifted tail into fresh slots
    shrink   lengths in SGLang's request / batch state, pos_offset (host and device), frontier
"""

from __future__ import annotations

import logging
import time

import torch

from sgl_kara import env
from sgl_kara.mem_cache.compaction import CompactionPlan, OutOfSlots, compact_rows
from sgl_kara.policies.base import RowView
from sgl_kara.scheduler.queries import ScoringComplete, ScoringPass, recompute_batch

logger = logging.getLogger(__name__)


class EventRunner:
    def __init__(self, rt):
        self.rt = rt  # the KaraRuntime: pools, policy, ring, forward context, stats

    def run(self, batch, jobs) -> None:
        rt = self.rt
        tic = time.perf_counter()
        cuda = rt.req_to_token_pool.req_to_token.device.type == "cuda"
        if cuda:
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        done = dropped = 0
        groups: dict[tuple, list] = {}
        for job in jobs:
            groups.setdefault(job.region.shape, []).append(job)
        pending = list(groups.values())
        while pending:
            group, short = self._fit(pending.pop())
            if short:
                rt.stats.skipped_no_memory += len(short)
                logger.info("Kara event skipped %d requests unscored: the pool cannot give their fresh slots",
                            len(short))
            if not group:
                continue
            try:
                n, d = self._compress_group(batch, group)
                done, dropped = done + n, dropped + n * d
            except OutOfSlots as e:
                rt.stats.skipped_no_memory += len(group)
                logger.info("Kara event skipped %d requests: %s", len(group), e)
            except Exception as e:  # noqa: BLE001 - isolate the failing request, keep serving
                if len(group) > 1:
                    pending.extend([job] for job in group)  # retry one by one to find the culprit
                else:
                    self._fail(group[0], e)
        seconds = time.perf_counter() - tic
        if cuda:
            rt.stats.event_peak_bytes = max(rt.stats.event_peak_bytes, torch.cuda.max_memory_allocated() - start)
        # Every attempt's time is compression time, also one that found no fresh slots after
        # scoring (OutOfSlots): its work was spent all the same.
        rt.stats.compression_seconds += seconds
        if rt.metrics is not None:
            rt.metrics.seconds.inc(seconds)
        if done:
            rt.stats.events += 1
            if rt.metrics is not None:
                rt.metrics.record_event(done, dropped)
            logger.info("Kara event #%d: %d requests compressed, %d KV entries freed, %.1f ms, %d free slots",
                        rt.stats.events, done, dropped, seconds * 1e3, rt.allocator.available_size())

    def _fit(self, group) -> tuple[list, list]:
        """(jobs whose fresh slots fit the pool now, in order; the rest). Read per group: a
        compacted group frees more slots than it took."""
        rt = self.rt
        free = rt.free_slots()
        fit, short = [], []
        for job in group:
            need = job.fresh_slots(rt.page_size)
            if need <= free:
                fit.append(job)
                free -= need
            else:
                short.append(job)
        return fit, short

    def _fail(self, job, error: Exception) -> None:
        """Finish one request with an error; its row is untouched, so SGLang frees it as usual."""
        from sgl_kara._sglang import FINISH_ABORT

        logger.error("Kara compression failed for request %s: %s", job.req.rid, error)
        job.state.enabled = False
        self.rt.stats.failed_requests += 1
        job.req.to_finish = FINISH_ABORT(f"KV compression failed: {error}", status_code=500)

    def _compress_group(self, batch, jobs) -> tuple[int, int]:
        rt = self.rt
        req_to_token = rt.req_to_token_pool.req_to_token
        device = req_to_token.device
        rows = torch.tensor([j.req.kv.req_pool_idx for j in jobs], dtype=torch.int64, device=device)
        M, K = jobs[0].region.length, jobs[0].region.keep
        starts = torch.tensor([j.region.start for j in jobs], dtype=torch.int64, device=device)
        region_slots = req_to_token[rows[:, None], starts[:, None] + torch.arange(M, device=device)].to(torch.int64)
        scores = self._scores(batch, jobs, rows, region_slots)  # [B, L, H_kv, M]
        kept = rt.policy.select(scores, K)
        lengths = [int(j.req.kv.kv_committed_len) for j in jobs]
        plan = CompactionPlan(rows=rows, starts=[j.region.start for j in jobs], lengths=lengths, region=M, kept=kept)
        k_bufs = [rt.kv_pool.get_key_buffer(l) for l in rt.layer_ids]
        v_bufs = [rt.kv_pool.get_value_buffer(l) for l in rt.layer_ids]
        d = compact_rows(plan, req_to_token, k_bufs, v_bufs, rt.alloc_slots, rt.allocator.free, rt.page_size)
        for b, j in enumerate(jobs):
            if rt.recorder is not None:
                rt.recorder.record(j.req, j.state, j.region.start, M, kept[b], lengths[b] + j.state.pos_offset)
            if rt.policy.observes_decode:
                rt.policy.on_compacted(j.state, j.region.start, M, kept[b], lengths[b])
        self._shrink(batch, jobs, rows, d, K)
        rt.stats.requests_compressed += len(jobs)
        rt.stats.tokens_dropped += d * len(jobs)
        return len(jobs), d

    def _shrink(self, batch, jobs, rows: torch.Tensor, d: int, keep: int) -> None:
        for j in jobs:
            j.req.kv.kv_committed_len -= d
            j.req.kv.kv_allocated_len -= d
            j.state.pos_offset += d
            j.state.frontier = j.region.start + keep
            j.state.compressions += 1
        if d:
            self.rt.forward.add_offset(rows, d)
            idx = torch.tensor([j.index for j in jobs], dtype=torch.int64)
            dev_idx = idx.to(batch.seq_lens.device)
            batch.seq_lens = batch.seq_lens.clone()
            batch.seq_lens[dev_idx] -= d
            batch.orig_seq_lens = batch.orig_seq_lens.clone()
            batch.orig_seq_lens[dev_idx] -= d
            if batch.seq_lens_cpu is not None:
                batch.seq_lens_cpu = batch.seq_lens_cpu.clone()
                batch.seq_lens_cpu[idx] -= d
            batch.seq_lens_sum = None

    # ------------------------------------------------------------------------------ scores
    def _scoring_pass(self, jobs, region_slots) -> ScoringPass:
        rt = self.rt
        views = [RowView(j.state.protected, j.state.frontier, int(j.req.kv.kv_committed_len), j.state.pos_offset,
                         j.state) for j in jobs]
        return ScoringPass(rt.policy, rt.kv_pool, rt.layer_ids, region_slots, views, [j.region for j in jobs])

    def _scores(self, batch, jobs, rows, region_slots) -> torch.Tensor:
        rt = self.rt
        fault = env.inject_fault_rid_prefix()
        if fault and any(str(j.req.rid).startswith(fault) for j in jobs):
            raise RuntimeError("injected fault (KARA_INJECT_FAULT_RID_PREFIX)")
        if not rt.policy.needs_queries:
            return self._scoring_pass(jobs, region_slots).score_without_queries()
        ring = rt.ring
        if ring is None:
            return self._recompute_scores(batch, jobs, rows, region_slots)
        q_starts = [j.region.query_start + j.state.pos_offset for j in jobs]  # logical
        held = [
            j.state.capture_from is not None and s >= j.state.capture_from and ring.holds(j.req)
            and (int(j.req.kv.kv_committed_len) + j.state.pos_offset) - s <= ring.capacity
            for s, j in zip(q_starts, jobs)
        ]
        fallbacks = held.count(False)
        if fallbacks:
            rt.stats.recompute_fallbacks += fallbacks
            if rt.metrics is not None:
                rt.metrics.fallbacks.inc(fallbacks)
        if fallbacks == len(jobs):
            return self._recompute_scores(batch, jobs, rows, region_slots)
        if not fallbacks:
            return self._captured_scores(batch, jobs, rows, region_slots, q_starts)
        # Some requests hold their window's queries in the ring, others (no free row, or their
        # queries left it): each part from its own source, in the jobs' order.
        parts = [[i for i, h in enumerate(held) if h], [i for i, h in enumerate(held) if not h]]
        idx = [torch.tensor(p, device=rows.device) for p in parts]
        captured = self._captured_scores(batch, [jobs[i] for i in parts[0]], rows[idx[0]], region_slots[idx[0]],
                                         [q_starts[i] for i in parts[0]])
        recomputed = self._recompute_scores(batch, [jobs[i] for i in parts[1]], rows[idx[1]], region_slots[idx[1]])
        out = captured.new_empty((len(jobs), *captured.shape[1:]))
        out[idx[0]] = captured
        out[idx[1]] = recomputed
        return out

    def _captured_scores(self, batch, jobs, rows, region_slots, q_starts) -> torch.Tensor:
        """Scores from the ring's queries, read for at most ``rt.recompute_tokens`` window tokens
        at a time (an event may hold every running request: the read is bounded like a recompute
        forward's activations)."""
        rt = self.rt
        per = max(1, rt.recompute_tokens // max(1, jobs[0].region.query_len))
        parts = []
        for i in range(0, len(jobs), per):
            scoring = self._scoring_pass(jobs[i : i + per], region_slots[i : i + per])
            starts = torch.tensor(q_starts[i : i + per], dtype=torch.int64, device=rows.device)
            ring_rows = rt.ring.rows_for(rows[i : i + per])
            for lid in rt.layer_ids:
                scoring.score_layer(lid, rt.ring.read(lid, ring_rows, starts, jobs[0].region.query_len))
            parts.append(scoring.result())
        captured = parts[0] if len(parts) == 1 else torch.cat(parts)
        if rt.check and not bool(torch.isfinite(captured).all()):  # the ring is NaN-poisoned in integrity mode
            raise AssertionError("scores from the capture ring are not finite: a window read queries never written")
        if env.crosscheck_queries():
            self._crosscheck(batch, jobs, rows, region_slots, captured)
        return captured

    def _crosscheck(self, batch, jobs, rows, region_slots, captured) -> None:
        """On a request's first window both query sources must agree (the prefix is exact)."""
        first = [i for i, j in enumerate(jobs) if j.state.compressions == 0]
        if not first:
            return
        sub = [jobs[i] for i in first]
        idx = torch.tensor(first, device=rows.device)
        recomputed = self._recompute_scores(batch, sub, rows[idx], region_slots[idx])
        for n, i in enumerate(first):
            a, b = captured[i], recomputed[n]
            jobs[i].state.crosscheck_err = float(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())

    def _recompute_scores(self, batch, jobs, rows, region_slots) -> torch.Tensor:
        """Scores from recompute forwards of at most ``rt.recompute_tokens`` window tokens each
        (SGLang budgets activation memory for its chunked-prefill size; B x W can exceed it)."""
        per = max(1, self.rt.recompute_tokens // max(1, jobs[0].region.query_len))
        parts = []
        for i in range(0, len(jobs), per):
            sub = jobs[i : i + per]
            scoring = self._scoring_pass(sub, region_slots[i : i + per])
            self._recompute(batch, sub, rows[i : i + per], scoring)
            parts.append(scoring.result())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _recompute(self, batch, jobs, rows, scoring: ScoringPass) -> None:
        """Extra forward over the query windows, reusing cached KV and writing none, stopped once
        the last layer's queries are scored (queries.ScoringComplete). Always eager:
        a replayed prefill CUDA graph would never call the attention hook (no queries reach the
        scoring pass) and was recorded with KV writes on."""
        from sgl_kara._sglang import ForwardBatch

        rt = self.rt
        mr = rt.model_runner
        sb = recompute_batch(batch, jobs, rows, rt.req_to_token_pool.req_to_token, scoring)
        graphs, mr.prefill_cuda_graph_runner = mr.prefill_cuda_graph_runner, None
        rt.forward.scoring = scoring
        try:
            fb = ForwardBatch.init_new(sb, mr, return_hidden_states_before_norm=False)
            with torch.inference_mode():
                mr.forward(fb)
        except ScoringComplete:
            pass  # every layer scored: the forward stopped before the last layer's attention
        finally:
            rt.forward.scoring = None
            mr.prefill_cuda_graph_runner = graphs
