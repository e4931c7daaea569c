"""Running one compression event over planned jobs: score, select, compact, shrink -- and the
spread scoring of upcoming windows between events (spread.py).

Scoring itself (captured or recomputed queries) is scoring.py's. Jobs are grouped by region shape (one batched score / select / compaction per group). Before a
group is scored, its jobs are fitted to the pool: compaction allocates fresh slots before it frees
the old ones, so a job whose fresh slots the pool (free + evictable) cannot give now is skipped
*unscored* -- scoring it would be wasted, and on a full pool a threshold policy's due request
would otherwise be scored again at every step (51,344 wasted scorings in one SnapKV run before
this rule). A group that still cannot get its slots is skipped (OutOfSlots: nothing changed).

An event is a transaction: everything that can fail runs while every row still names its old
slots, and the commit is index writes only.

    score    ScoringPass over the policy's query window, or what is left of it after the spread
             steps: captured queries for the jobs whose window is still in the ring, a recompute
             forward (paper App. C.2) for the others; the policy's own scores when it needs no
             queries
    select   policy.select(scores [B, L, H_kv, M], K) -> kept [B, L, H_kv, K]
    prepare  fresh slots allocated, kept K/V copied into them (mem_cache.compaction), the
             policy's per-request state re-laid into copies, the eviction record built
    commit   rows rewritten, old slots freed, lengths shrunk in SGLang's request / batch state,
             pos_offset (host and device), frontier, the copies kept

A group that fails before its commit is undone (its fresh slots given back, no row or state
changed) and retried request by request so the failing request is found; that request finishes
with an error (HTTP 500) and its row is left untouched (SGLang frees it as usual); the others are
compressed.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from sgl_kara import env
from sgl_kara.mem_cache.compaction import CompactionPlan, OutOfSlots, prepare_compaction
from sgl_kara.scheduler.scoring import Scorer

logger = logging.getLogger(__name__)

FAULT_STAGES = (
    "score",
    "commit",
)  # KARA_INJECT_FAULT_AT: before scoring, or just before the commit


class EventRunner:
    def __init__(self, rt):
        self.rt = rt  # the KaraRuntime: pools, policy, ring, forward context, stats
        self.scorer = Scorer(rt)

    # ------------------------------------------------------------------------------ events
    def run(self, batch, jobs) -> int:
        """Compress ``jobs``; returns the KV slots freed."""
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
                logger.debug(
                    "Kara event skipped %d requests unscored: the pool cannot give their fresh slots",
                    len(short),
                )
            if not group:
                continue
            try:
                n, d = self._compress_group(batch, group)
                done, dropped = done + n, dropped + n * d
            except OutOfSlots as e:
                rt.stats.skipped_no_memory += len(group)
                logger.debug("Kara event skipped %d requests: %s", len(group), e)
            except Exception as e:  # noqa: BLE001 - isolate the failing request, keep serving
                if len(group) > 1:
                    pending.extend(
                        [job] for job in group
                    )  # undone: retry one by one to find the culprit
                else:
                    self._fail(group[0], e)
        seconds = time.perf_counter() - tic
        if cuda:
            rt.stats.event_peak_bytes = max(
                rt.stats.event_peak_bytes, torch.cuda.max_memory_allocated() - start
            )
        # Every attempt's time is compression time, also one that found no fresh slots after
        # scoring (OutOfSlots): its work was spent all the same.
        rt.stats.compression_seconds += seconds
        if rt.metrics is not None:
            rt.metrics.seconds.inc(seconds)
        if done:
            rt.stats.events += 1
            if rt.metrics is not None:
                rt.metrics.record_event(done, dropped)
            logger.debug(
                "Kara event #%d: %d requests compressed, %d KV entries freed, %.1f ms, %d free slots",
                rt.stats.events,
                done,
                dropped,
                seconds * 1e3,
                rt.allocator.available_size(),
            )
        return dropped

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
        job.state.scoring = None
        self.rt.stats.failed_requests += 1
        job.req.to_finish = FINISH_ABORT(
            f"KV compression failed: {error}", status_code=500
        )

    def _compress_group(self, batch, jobs) -> tuple[int, int]:
        rt = self.rt
        req_to_token = rt.req_to_token_pool.req_to_token
        device = req_to_token.device
        row_ids = [int(j.req.kv.req_pool_idx) for j in jobs]
        rows = torch.tensor(row_ids, dtype=torch.int64, device=device)
        M, K = jobs[0].region.length, jobs[0].region.keep
        starts = torch.tensor(
            [j.region.start for j in jobs], dtype=torch.int64, device=device
        )
        region_slots = req_to_token[
            rows[:, None], starts[:, None] + torch.arange(M, device=device)
        ].to(torch.int64)
        self._inject_fault("score", jobs)
        scores = self._complete_scores(
            batch, jobs, rows, region_slots
        )  # [B, L, H_kv, M]
        kept = rt.policy.select(scores, K)
        lengths = [int(j.req.kv.kv_committed_len) for j in jobs]
        plan = CompactionPlan(
            rows=rows,
            starts=[j.region.start for j in jobs],
            lengths=lengths,
            region=M,
            kept=kept,
            row_ids=row_ids,
        )
        k_bufs = [rt.kv_pool.get_key_buffer(layer_id) for layer_id in rt.layer_ids]
        v_bufs = [rt.kv_pool.get_value_buffer(layer_id) for layer_id in rt.layer_ids]
        prepared = prepare_compaction(
            plan,
            req_to_token,
            k_bufs,
            v_bufs,
            rt.alloc_slots,
            rt.allocator.free,
            rt.page_size,
        )
        try:
            relaid = [
                self._relaid_policy_state(j, M, kept[b], lengths[b])
                for b, j in enumerate(jobs)
            ]
            records = None
            if rt.recorder is not None:
                records = [
                    rt.recorder.prepare(
                        j.req,
                        j.state,
                        j.region.start,
                        M,
                        kept[b],
                        lengths[b] + j.state.pos_offset,
                    )
                    for b, j in enumerate(jobs)
                ]
            self._inject_fault("commit", jobs)
        except BaseException:
            prepared.abort(rt.allocator.free)
            raise
        # ---- commit: index writes and host bookkeeping only
        d = prepared.commit(req_to_token, rt.allocator.free)
        for b, j in enumerate(jobs):
            if relaid[b] is not None:
                j.state.policy_state = relaid[b]
            if records is not None:
                rt.recorder.commit(j.state, records[b])
            j.state.scoring = None
        self._shrink(batch, jobs, rows, d, K)
        rt.stats.requests_compressed += len(jobs)
        rt.stats.tokens_dropped += d * len(jobs)
        return len(jobs), d

    def _relaid_policy_state(self, job, M: int, kept: torch.Tensor, length: int):
        """The policy's per-request state re-laid for the compaction, in a copy (None: nothing to re-lay)."""
        if not self.rt.policy.observes_decode:
            return None
        shadow = copy.copy(job.state)
        shadow.policy_state = _copy_dicts(job.state.policy_state)
        self.rt.policy.on_compacted(shadow, job.region.start, M, kept, length)
        return shadow.policy_state

    def _inject_fault(self, stage: str, jobs) -> None:
        fault = env.inject_fault_rid_prefix()
        if (
            fault
            and env.inject_fault_stage() == stage
            and any(str(j.req.rid).startswith(fault) for j in jobs)
        ):
            raise RuntimeError(
                f"injected fault at {stage} (KARA_INJECT_FAULT_RID_PREFIX)"
            )

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
    def _complete_scores(self, batch, jobs, rows, region_slots) -> torch.Tensor:
        """[B, L, H_kv, M]: each job's spread scores (state.scoring) plus the queries not yet
        scored, scored now (all of them when the window was not spread)."""
        rt = self.rt
        if not rt.policy.needs_queries:
            return self.scorer.scoring_pass(jobs, region_slots).score_without_queries()
        partial = []
        for j in jobs:
            s = j.state.scoring
            partial.append(
                s if s is not None and s.covers(j.region) and s.done > 0 else None
            )
        by_left: dict[int, list[int]] = {}
        for b, (j, s) in enumerate(zip(jobs, partial)):
            left = j.region.query_len - (s.done if s is not None else 0)
            if left > 0:
                by_left.setdefault(left, []).append(b)
        fresh = {}
        for left, idx in by_left.items():
            sel = torch.tensor(idx, device=rows.device)
            sub = [jobs[b] for b in idx]
            q_lo = [j.region.query_start + j.region.query_len - left for j in sub]
            got = self.scorer.score(
                batch, sub, rows[sel], region_slots[sel], q_lo, left
            )
            for n, b in enumerate(idx):
                fresh[b] = got[n]
        out = []
        for b, s in enumerate(partial):
            part = fresh.get(b)
            if s is None:
                out.append(part)
            else:
                out.append(s.scores if part is None else s.scores + part)
        return torch.stack(out)

    def advance(self, batch, chunks) -> int:
        """Score ``chunks`` [(job, n)]: the next ``n`` queries of each job's upcoming window, added
        to its ``state.scoring``; returns the queries scored. A chunk that fails is dropped with
        its job (scored whole at the event instead)."""
        rt = self.rt
        tic = time.perf_counter()
        req_to_token = rt.req_to_token_pool.req_to_token
        device = req_to_token.device
        groups: dict[tuple, list] = {}
        for job, n in chunks:
            groups.setdefault((job.region.length, n), []).append(job)
        scored = 0
        for (M, n), group in groups.items():
            row_ids = [int(j.req.kv.req_pool_idx) for j in group]
            rows = torch.tensor(row_ids, dtype=torch.int64, device=device)
            starts = torch.tensor(
                [j.region.start for j in group], dtype=torch.int64, device=device
            )
            slots = req_to_token[
                rows[:, None], starts[:, None] + torch.arange(M, device=device)
            ].to(torch.int64)
            q_lo = [j.region.query_start + j.state.scoring.done for j in group]
            try:
                got = self.scorer.score(batch, group, rows, slots, q_lo, n)
            except Exception as e:  # noqa: BLE001 - the event scores these windows whole instead
                logger.warning(
                    "Kara spread scoring failed for %d requests (%s); scored at their events",
                    len(group),
                    e,
                )
                for j in group:
                    j.state.scoring = None
                continue
            for b, j in enumerate(group):
                j.state.scoring.add(got[b], n)
            scored += n * len(group)
        seconds = time.perf_counter() - tic
        rt.stats.compression_seconds += seconds
        rt.stats.spread_seconds += seconds
        rt.stats.spread_queries += scored
        if rt.metrics is not None:
            rt.metrics.seconds.inc(seconds)
        return scored


def _copy_dicts(d):
    """A copy of nested dicts (tensors and other leaves shared)."""
    return {k: _copy_dicts(v) if isinstance(v, dict) else v for k, v in d.items()}
