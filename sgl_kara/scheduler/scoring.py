"""Scoring a batch of regions by a span of their query windows: captured queries where the ring
still holds them, a recompute forward (paper App. C.2) for the others, or the policy's own scores
when it needs no queries. Used whole at an event and a span at a time by the spread steps
(events.py, spread.py)."""

from __future__ import annotations

import torch

from sgl_kara import env
from sgl_kara.policies.base import RowView
from sgl_kara.scheduler.queries import ScoringComplete, ScoringPass, recompute_batch


class Scorer:
    def __init__(self, rt):
        self.rt = rt  # the KaraRuntime: pools, policy, ring, model runner, forward context, stats

    def scoring_pass(self, jobs, region_slots) -> ScoringPass:
        rt = self.rt
        views = [
            RowView(
                j.state.protected,
                j.state.frontier,
                int(j.req.kv.kv_committed_len),
                j.state.pos_offset,
                j.state,
            )
            for j in jobs
        ]
        return ScoringPass(
            rt.policy,
            rt.kv_pool,
            rt.layer_ids,
            region_slots,
            views,
            [j.region for j in jobs],
        )

    def score(
        self, batch, jobs, rows, region_slots, q_lo: list[int], n: int
    ) -> torch.Tensor:
        """[B, L, H_kv, M] scores of the regions by the ``n`` queries of each job from physical row
        ``q_lo[b]``: captured where the ring still holds them, recomputed for the others."""
        ring = self.rt.ring
        if ring is None:
            return self._recompute_scores(batch, jobs, rows, region_slots, q_lo, n)
        q_starts = [lo + j.state.pos_offset for lo, j in zip(q_lo, jobs)]  # logical
        held = [
            j.state.capture_from is not None
            and s >= j.state.capture_from
            and ring.holds(j.req)
            and (int(j.req.kv.kv_committed_len) + j.state.pos_offset) - s
            <= ring.capacity
            for s, j in zip(q_starts, jobs)
        ]
        fallbacks = held.count(False)
        # counted once per window: at the span holding its first query (a spread window is scored
        # a span per step; a later span is held whenever the first one is)
        windows = sum(
            not h and lo == j.region.query_start for h, lo, j in zip(held, q_lo, jobs)
        )
        if windows:
            self.rt.stats.recompute_fallbacks += windows
            if self.rt.metrics is not None:
                self.rt.metrics.fallbacks.inc(windows)
        if fallbacks == len(jobs):
            return self._recompute_scores(batch, jobs, rows, region_slots, q_lo, n)
        if not fallbacks:
            return self._captured_scores(batch, jobs, rows, region_slots, q_starts, n)
        # Some requests hold their window's queries in the ring, others (no free row, or their
        # queries left it): each part from its own source, in the jobs' order.
        parts = [
            [i for i, h in enumerate(held) if h],
            [i for i, h in enumerate(held) if not h],
        ]
        idx = [torch.tensor(p, device=rows.device) for p in parts]
        captured = self._captured_scores(
            batch,
            [jobs[i] for i in parts[0]],
            rows[idx[0]],
            region_slots[idx[0]],
            [q_starts[i] for i in parts[0]],
            n,
        )
        recomputed = self._recompute_scores(
            batch,
            [jobs[i] for i in parts[1]],
            rows[idx[1]],
            region_slots[idx[1]],
            [q_lo[i] for i in parts[1]],
            n,
        )
        out = captured.new_empty((len(jobs), *captured.shape[1:]))
        out[idx[0]] = captured
        out[idx[1]] = recomputed
        return out

    def _captured_scores(
        self, batch, jobs, rows, region_slots, q_starts, n: int | None = None
    ) -> torch.Tensor:
        """Scores from the ring's queries (``n`` from logical position ``q_starts[b]``; default
        the jobs' query window), read for at most ``rt.recompute_tokens`` query tokens at a time
        (an event may hold every running request: the read is bounded like a recompute forward's
        activations)."""
        rt = self.rt
        n = jobs[0].region.query_len if n is None else n
        per = max(1, rt.recompute_tokens // max(1, n))
        parts = []
        for i in range(0, len(jobs), per):
            scoring = self.scoring_pass(jobs[i : i + per], region_slots[i : i + per])
            starts = torch.tensor(
                q_starts[i : i + per], dtype=torch.int64, device=rows.device
            )
            ring_rows = rt.ring.rows_for(rows[i : i + per])
            for lid in rt.layer_ids:
                scoring.score_layer(lid, rt.ring.read(lid, ring_rows, starts, n))
            parts.append(scoring.result())
        captured = parts[0] if len(parts) == 1 else torch.cat(parts)
        if rt.check and not bool(
            torch.isfinite(captured).all()
        ):  # the ring is NaN-poisoned in integrity mode
            raise AssertionError(
                "scores from the capture ring are not finite: a window read queries never written"
            )
        if env.crosscheck_queries():
            self._crosscheck(batch, jobs, rows, region_slots, captured, q_starts, n)
        return captured

    def _crosscheck(
        self, batch, jobs, rows, region_slots, captured, q_starts, n
    ) -> None:
        """On a request's first window both query sources must agree (the prefix is exact)."""
        first = [i for i, j in enumerate(jobs) if j.state.compressions == 0]
        if not first:
            return
        sub = [jobs[i] for i in first]
        idx = torch.tensor(first, device=rows.device)
        q_lo = [q_starts[i] - jobs[i].state.pos_offset for i in first]
        recomputed = self._recompute_scores(
            batch, sub, rows[idx], region_slots[idx], q_lo, n
        )
        for k, i in enumerate(first):
            a, b = captured[i], recomputed[k]
            err = float(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
            prev = jobs[i].state.crosscheck_err
            jobs[i].state.crosscheck_err = err if prev is None else max(prev, err)

    def _recompute_scores(
        self,
        batch,
        jobs,
        rows,
        region_slots,
        q_lo: list[int] | None = None,
        n: int | None = None,
    ) -> torch.Tensor:
        """Scores from recompute forwards of at most ``rt.recompute_tokens`` query tokens each
        (SGLang budgets activation memory for its chunked-prefill size; B x W can exceed it)."""
        n = jobs[0].region.query_len if n is None else n
        q_lo = [j.region.query_start for j in jobs] if q_lo is None else q_lo
        per = max(1, self.rt.recompute_tokens // max(1, n))
        parts = []
        for i in range(0, len(jobs), per):
            sub = jobs[i : i + per]
            scoring = self.scoring_pass(sub, region_slots[i : i + per])
            self._recompute(
                batch, sub, rows[i : i + per], scoring, q_lo[i : i + per], n
            )
            parts.append(scoring.result())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _recompute(
        self, batch, jobs, rows, scoring: ScoringPass, q_lo: list[int], n: int
    ) -> None:
        """Extra forward over the query tokens, reusing cached KV and writing none, stopped once
        the last layer's queries are scored (queries.ScoringComplete). Always eager:
        a replayed prefill CUDA graph would never call the attention hook (no queries reach the
        scoring pass) and was recorded with KV writes on."""
        from sgl_kara._sglang import ForwardBatch

        rt = self.rt
        mr = rt.model_runner
        sb = recompute_batch(
            batch, jobs, rows, rt.req_to_token_pool.req_to_token, scoring, q_lo, n
        )
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
