"""Running one compression event over planned jobs -- and a spread step's scoring parts.

Jobs are grouped by region shape and each group is taken a chunk at a time (at most one
recompute forward's worth of query windows: the event's scores and selection stay within the
memory planned for them, memory_plan.event_chunk). Before a chunk is scored its jobs are fitted
to the pool: compaction allocates fresh slots before it frees the old ones, so a job whose fresh
slots the pool (free + evictable) cannot give now is skipped *unscored* -- scoring it would be
wasted, and on a full pool a threshold policy's due request would otherwise be scored again at
every step. A chunk that still cannot get its slots is skipped (OutOfSlots: nothing changed).

An event runs in two halves around the step's fence (the point after which its work is ordered
after the forward in flight, runtime.py): what SGLang's own calls may make the host wait for runs
before it, and only what never waits runs after it.

    before   settle  the jobs that fit the pool (free + evictable); the radix tree evicted for
                     them (SGLang's eviction frees with ``free``: a ``torch.unique`` at page size
                     > 1); their query windows scored as far as their rows are settled (no
                     forward in flight writes them): the recompute forward, whose attention
                     metadata may copy to the host (FlashInfer's ``plan()``), waits for the
                     schedule stream only
    --- fence ---
    after    score   what is left of each window: its query in flight (overlap: the newest row;
                     from the capture ring, or a recompute forward when a window ends there)
             select  policy.select(scores [B, L, H_kv, M], K) -> kept [B, L, H_kv, K]
                     (and the regions' token ids [B, M] for a needs_tokens policy)
             prepare fresh slots allocated, kept K/V copied into them (mem_cache.compaction),
                     the policy's per-request state re-laid into copies, the eviction record
             commit  rows rewritten, old pages freed by id (``free_page_ids``: no wait), lengths
                     shrunk in SGLang's request / batch state, pos_offset (host and device),
                     frontier, the copies kept

A chunk that fails before its commit is undone (its fresh slots given back, no row or state
changed) and retried request by request so the failing request is found; that request finishes
with an error (HTTP 500) and its row is left untouched (SGLang frees it as usual); the others are
compressed. Every index tensor reaches the device through ``staging`` (no host wait). Policies
that observe decode (their scores read state the forward in flight writes) score after the fence.

Under tensor parallelism the ranks agree on each chunk's outcome, and on each spread group's,
just before its commit (tp_lockstep.FailureAgreement): one failed on any rank is undone on every
rank, so no rank rewrites a row the others leave as it was.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from sgl_kara import _sglang as adapter
from sgl_kara.mem_cache.compaction import (
    CompactionPlan,
    OutOfSlots,
    prepare_compaction,
)
from sgl_kara.memory_plan import event_chunk
from sgl_kara.scheduler.spread import ScoringJob

logger = logging.getLogger(__name__)


class ReleaseStep(NamedTuple):
    """What the backend's tail release may need of the event: the pools, the staging, the
    forward context (position offsets) and the requests' rows on the device."""

    parts: object
    staging: object
    forward: object
    rows: torch.Tensor


class EventRunner:
    """``shared``: the step's policy, pools, staging, counters, observers (told of each chunk's
    ``score`` and ``commit`` stages; none in production) and backend (how SGLang's rows and
    lengths are released) (shared.StepShared); ``scorer``: scoring.Scorer; ``forward``: the
    device offsets; ``recorder``: the eviction record or None; ``agreement``: the
    tensor-parallel ranks' agreement on each chunk's outcome (tp_lockstep.FailureAgreement;
    None: one rank); ``in_flight``: a running request's newest rows a forward in flight writes
    while the step runs (SGLang's overlap scheduler: 1), scored only after the fence."""

    def __init__(
        self, shared, scorer, forward, recorder=None, agreement=None, in_flight: int = 0
    ):
        self.policy, self.parts, self.backend = (
            shared.policy,
            shared.parts,
            shared.backend,
        )
        self.staging, self.stats, self.metrics = (
            shared.staging,
            shared.stats,
            shared.metrics,
        )
        self.observers, self.check = shared.observers, shared.check
        self.scorer = scorer
        self.forward = forward
        self.recorder = recorder
        self.agreement = agreement
        self.agreed = False  # this attempt's outcome told to the other TP ranks
        # a running request's newest rows a forward in flight writes (overlap scheduler: 1)
        self.in_flight = in_flight

    # -------------------------------------------------------------------------- events
    def run(self, batch, jobs) -> int:
        """Compress ``jobs``: settle, fence, then chunk by chunk score -> select -> prepare ->
        commit. Returns the KV slots freed."""
        tic = time.perf_counter()
        cuda = self.parts.req_to_token.device.type == "cuda"
        if cuda:  # allocator statistics: host-side, no wait
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        done = dropped = 0
        groups: dict[tuple, list] = {}
        for job in jobs:
            groups.setdefault(job.region.shape, []).append(job)
        pending = []
        for group in groups.values():
            per = event_chunk(
                self.parts.recompute_tokens, group[0].region.query_len or 1
            )
            pending += [group[i : i + per] for i in range(0, len(group), per)]
        pending = self._settle(pending)
        self._fence()
        pending.reverse()
        while pending:
            chunk, short = self._fit(pending.pop(), evict=False)
            if short:
                self.stats.skipped_no_memory += len(short)
            if not chunk:
                continue
            self.agreed = False
            try:
                n, per_row = self._compress(batch, chunk)
                done, dropped = done + n, dropped + n * per_row
            except OutOfSlots as e:
                self._agree_failed()
                self.stats.skipped_no_memory += len(chunk)
                logger.debug("Kara event skipped %d requests: %s", len(chunk), e)
            except Exception as e:  # noqa: BLE001 - isolate the failing request, keep serving
                self._agree_failed()
                if len(chunk) > 1:
                    pending.extend([job] for job in chunk)  # undone: retry one by one
                else:
                    self._fail(chunk[0], e)
        seconds = time.perf_counter() - tic
        if cuda:
            peak = torch.cuda.max_memory_allocated() - start
            self.stats.event_peak_bytes = max(self.stats.event_peak_bytes, peak)
        # Every attempt's time is compression time, also one that found no fresh slots after
        # scoring (OutOfSlots): its work was spent all the same.
        self.stats.compression_seconds += seconds
        if self.metrics is not None:
            self.metrics.seconds.inc(seconds)
        if done:
            self.stats.events += 1
            if self.metrics is not None:
                self.metrics.record_event(done, dropped)
        return dropped

    def _fence(self) -> None:
        """Under SGLang's overlap scheduler on CUDA the previous batch's forward may still run on
        the forward stream while this step is planned, reading the rows and slots an event
        rewrites and writing the ring / observer state and the newest row it reads: order this
        event's work after it on the device (stream order, as SGLang's own barrier does; the
        host does not wait: every copy of the step is staged, staging.py, and pages are freed by
        id). The next forward waits for this stream (SGLang's run_batch). A host wait before the
        fence waits for the schedule stream only, not for that forward."""
        self.observers.fenced()
        if self.parts.forward_stream is not None:
            torch.cuda.current_stream().wait_stream(self.parts.forward_stream)

    def _settle(self, chunks) -> list:
        """Before the fence: each chunk's jobs fitted to the pool as it is (no credit for what
        earlier chunks free; a job left out is fitted again after the fence, and scored then),
        the radix tree evicted for those that fit, and their query windows scored as far as
        their rows are settled (added to ``state.scoring``, as spread parts are). Returns the
        chunks, every job in them."""
        parts = self.parts
        free = parts.available() + parts.evictable()
        need = 0
        early = []
        for chunk in chunks:
            for job in chunk:
                n = job.fresh_slots(parts.page_size)
                if n <= free:
                    free -= n
                    need += n
                    early.append(job)
        parts.reserve(need)
        policy = self.policy
        if not policy.needs_queries or policy.observes_decode:
            return chunks  # scores from no queries, or from state the forward writes
        parts_now = []
        for job in early:
            s = job.state.scoring
            if s is None or not s.covers(job.region):
                s = job.state.open_scoring(ScoringJob(job.region))
            r = job.region
            end = r.query_start + r.query_len
            end = min(
                end, job.length - self.in_flight
            )  # rows no forward in flight writes
            n = end - (r.query_start + s.done)
            if n > 0 and (policy.additive or n == s.remaining):
                parts_now.append((job, n))
        if parts_now:
            self.advance(parts_now, spread=False)
        return chunks

    def _fit(self, jobs, evict: bool = True) -> tuple[list, list]:
        """(jobs whose fresh slots fit the pool now, in order; the rest). Read per chunk: a
        compacted chunk frees more slots than it took. ``evict``: count what the radix tree
        could give (after the fence nothing is evicted: the slots were reserved before it)."""
        free = self.parts.available() + (self.parts.evictable() if evict else 0)
        fit, short = [], []
        for job in jobs:
            need = job.fresh_slots(self.parts.page_size)
            if need <= free:
                fit.append(job)
                free -= need
            else:
                short.append(job)
        return fit, short

    def _fail(self, job, error: Exception) -> None:
        """Finish one request with an error; its row is untouched, so SGLang frees it as usual."""
        logger.error(
            "Kara compression failed for request %s: %s", adapter.rid(job.req), error
        )
        logger.debug(
            "Kara compression failure of %s", adapter.rid(job.req), exc_info=error
        )
        job.state.disable()
        self.stats.failed_requests += 1
        adapter.abort(job.req, f"KV compression failed: {error}", 500)

    def _region_slots(self, jobs, M: int):
        """(rows [B], the regions' pool slots [B, M]) on the device."""
        parts = self.parts
        rows = self.staging.to_device([j.row for j in jobs])
        starts = self.staging.to_device([j.region.start for j in jobs])
        offs = torch.arange(M, device=parts.req_to_token.device)
        slots = parts.req_to_token[rows[:, None], starts[:, None] + offs[None, :]]
        return rows, starts, slots.to(torch.int64)

    def _region_tokens(self, jobs, M: int) -> torch.Tensor:
        """[B, M] int64 the regions' token ids on the device, from the requests' token lists
        (a region lies in the uncompressed tail: row p is token p + pos_offset), staged."""
        ids = []
        for j in jobs:
            lo = j.region.start + j.state.pos_offset
            ids.extend(adapter.token_ids(j.req, lo, lo + M))
        return self.staging.to_device(ids).reshape(len(jobs), M)

    def _compress(self, batch, jobs) -> tuple[int, int]:
        """One chunk's transaction: score -> select -> prepare -> commit; undone (its fresh
        slots given back) if anything before the commit fails. Returns (jobs, rows dropped
        from each)."""
        M, K = jobs[0].region.length, jobs[0].region.keep
        rows, starts, region_slots = self._region_slots(jobs, M)
        self.observers.stage("score", jobs)  # before the rest of the window is scored
        scores = self._complete_scores(jobs, rows, region_slots)  # [B, L, H_kv, M]
        if self.policy.needs_tokens:
            kept = self.policy.select(scores, K, tokens=self._region_tokens(jobs, M))
        else:
            kept = self.policy.select(scores, K)
        lengths = [j.length for j in jobs]
        prepared = self._prepare(jobs, rows, starts, region_slots, kept, lengths)
        try:
            relaid = [
                self._relaid_policy_state(j, M, kept[b], lengths[b])
                for b, j in enumerate(jobs)
            ]
            records = self._records(jobs, M, kept, lengths)
            self.observers.stage("commit", jobs)
            self._agree()
        except BaseException:
            prepared.abort(self.parts.free_page_ids)
            raise
        return len(jobs), self._commit(batch, jobs, rows, prepared, relaid, records)

    def _prepare(self, jobs, rows, starts, region_slots, kept, lengths):
        """Fresh slots allocated and the kept K/V copied into them (mem_cache.compaction);
        nothing any request reads changed yet."""
        parts = self.parts
        plan = CompactionPlan(
            rows=rows,
            starts=[j.region.start for j in jobs],
            lengths=lengths,
            region=jobs[0].region.length,
            kept=kept,
            row_ids=[j.row for j in jobs],
            device_starts=starts,
            region_slots=region_slots,
        )
        return prepare_compaction(
            plan,
            parts.req_to_token,
            [parts.keys(layer_id) for layer_id in parts.layer_ids],
            [parts.values(layer_id) for layer_id in parts.layer_ids],
            parts.alloc,
            parts.free_page_ids,
            parts.page_size,
            check=self.check,
        )

    def _records(self, jobs, M: int, kept, lengths) -> list | None:
        """KARA_RECORD_EVICTIONS: each request's eviction record, prepared (None: not asked)."""
        if self.recorder is None:
            return None
        return [
            self.recorder.prepare(
                adapter.rid(j.req),
                j.state,
                j.region.start,
                M,
                kept[b],
                lengths[b] + j.state.pos_offset,
            )
            for b, j in enumerate(jobs)
        ]

    def _commit(self, batch, jobs, rows, prepared, relaid, records) -> int:
        """Index writes and host bookkeeping only: SGLang's rows, slots and lengths (the
        backend's tail release), then Kara's state. Returns the rows dropped from each."""
        step = ReleaseStep(self.parts, self.staging, self.forward, rows)
        dropped = self.backend.release_tail(batch, jobs, prepared, step)
        keep = jobs[0].region.keep
        for b, j in enumerate(jobs):
            if records is not None:
                self.recorder.commit(j.state, records[b])
            j.state.committed(j.region.start + keep, dropped, relaid[b])
        self.stats.requests_compressed += len(jobs)
        self.stats.tokens_dropped += dropped * len(jobs)
        return dropped

    def _relaid_policy_state(self, job, M: int, kept: torch.Tensor, length: int):
        """The policy's per-request state re-laid for the compaction, in a copy (None: nothing
        to re-lay)."""
        if not self.policy.observes_decode:
            return None
        shadow = job.state.relaid(_copy_dicts(job.state.policy_state))
        self.policy.on_compacted(shadow, job.region.start, M, kept, length)
        return shadow.policy_state

    def _agree(self) -> None:
        """Under TP: this rank's chunk is ready to commit; raises PeerFailed if another rank's
        failed (the chunk is then undone here too)."""
        if self.agreement is not None:
            self.agreed = True
            self.agreement.check()

    def _agree_failed(self) -> None:
        """Under TP: this rank's chunk failed before the agreement; the other ranks are told."""
        if self.agreement is not None and not self.agreed:
            self.agreed = True
            self.agreement.failed_ranks(True)

    # -------------------------------------------------------------------------- scores
    def _complete_scores(self, jobs, rows, region_slots) -> torch.Tensor:
        """[B, L, H_kv, M]: each job's spread scores (state.scoring) plus the queries not yet
        scored, scored now (all of them when the window was not spread)."""
        if not self.policy.needs_queries:
            return self.scorer.score(jobs, rows, region_slots, [], 0)
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
            sel = self.staging.to_device(idx)
            sub = [jobs[b] for b in idx]
            q_lo = [j.region.query_start + j.region.query_len - left for j in sub]
            got = self.scorer.score(sub, rows[sel], region_slots[sel], q_lo, left)
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

    def advance(self, chunks, spread: bool = True) -> int:
        """Score ``chunks`` [(job, n)]: the next ``n`` queries of each job's upcoming window,
        added to its ``state.scoring``; returns the queries scored. A chunk that fails is
        dropped with its job (scored whole at the event instead). ``spread``: parts of windows
        ahead of their events (counted as such), else an event's settled queries."""
        tic = time.perf_counter()
        groups: dict[tuple, list] = {}
        for job, n in chunks:
            groups.setdefault((job.region.length, n), []).append(job)
        scored = 0
        for (M, n), group in groups.items():
            rows, _, slots = self._region_slots(group, M)
            q_lo = [j.region.query_start + j.state.scoring.done for j in group]
            self.agreed = False
            try:
                got = self.scorer.score(group, rows, slots, q_lo, n)
                self._agree()
            except Exception as e:  # noqa: BLE001 - the event scores these windows whole
                self._agree_failed()
                logger.warning(
                    "Kara spread scoring failed for %d requests (%s); scored at their events",
                    len(group),
                    e,
                )
                for j in group:
                    j.state.drop_scoring()
                continue
            for b, j in enumerate(group):
                j.state.scoring.add(got[b], n)
            scored += n * len(group)
        seconds = time.perf_counter() - tic
        if spread:  # an event's own scoring counts in its run's time
            self.stats.compression_seconds += seconds
            self.stats.spread_seconds += seconds
            self.stats.spread_queries += scored
            if self.metrics is not None:
                self.metrics.seconds.inc(seconds)
        return scored


def _copy_dicts(dropped):
    """A copy of nested dicts (tensors and other leaves shared)."""
    return {k: _copy_dicts(v) if isinstance(v, dict) else v for k, v in dropped.items()}
