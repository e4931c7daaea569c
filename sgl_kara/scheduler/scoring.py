"""Scores of a batch of regions by a span of their query windows: captured queries where the ring
still holds them, a recompute forward (recompute.py) for the others, or the policy's own scores
when it needs no queries. Used whole at an event and a part at a time by spread steps.

Both query sources end in the same per-layer call, ``ScoringPass.score_layer(layer_id, q)``,
with ``q`` of shape ``[B, n, H_q, D]`` (post-RoPE queries of the span), which asks the policy to
score the region's keys (read through the requests' slot indices).
"""

from __future__ import annotations

import torch

from sgl_kara.policies.base import ScoreInput
from sgl_kara.scheduler.recompute import ScoringComplete, extend_rows


class ScoringPass:
    """Collects ``[B, L, H_kv, M]`` scores of one batch of jobs (all regions the same shape),
    one layer at a time, from ``policy.score``. ``slots``: ``[B, M]`` pool slots of the region
    keys; ``rows`` / ``regions``: the jobs' RowViews and Regions; ``heads``: (the model's index
    of this rank's first KV head, the model's KV heads; None: this rank holds them all)."""

    def __init__(
        self,
        policy,
        keys_of,
        layer_ids,
        slots: torch.Tensor,
        rows,
        regions,
        heads: tuple[int, int | None] = (0, None),
        backend=None,
    ):
        self.policy = policy
        self.heads = heads
        self.keys_of = keys_of
        self.layer_index = {lid: i for i, lid in enumerate(layer_ids)}
        self.slots = slots
        self.rows, self.regions = rows, regions
        self.B, self.M = slots.shape
        self.scores: torch.Tensor | None = None
        self.seen: set[int] = set()
        self.last_layer = max(layer_ids)
        # a recompute forward's failure inside the model, raised once the forward has left it
        # (under tensor parallelism every rank runs the forward to the same layer: forward.py)
        self.error: BaseException | None = None
        # A recompute forward: the window tokens' logical positions and pool slots, [B * n].
        self.positions: torch.Tensor | None = None
        self.window_slots: torch.Tensor | None = None

    def score_layer(self, layer_id: int, q: torch.Tensor | None) -> None:
        """q: [B, n, H_q, D] window queries of this layer (post-RoPE), or None."""
        inp = ScoreInput(
            self.layer_index[layer_id],
            q,
            self.keys_of(layer_id),
            self.slots,
            self.rows,
            self.regions,
            *self.heads,
        )
        s = self.policy.score(inp)  # [B, H_kv, M]
        if self.scores is None:
            self.scores = torch.zeros(
                (self.B, len(self.layer_index), s.shape[1], self.M),
                dtype=torch.float32,
                device=s.device,
            )
        self.scores[:, self.layer_index[layer_id]] = s
        self.seen.add(layer_id)

    def score_without_queries(self) -> torch.Tensor:
        for lid in self.layer_index:
            self.score_layer(lid, None)
        return self.result()

    def result(self) -> torch.Tensor:
        missing = set(self.layer_index) - self.seen
        if missing:
            raise RuntimeError(
                f"scoring pass saw no queries for layers {sorted(missing)}"
            )
        return self.scores


class Scorer:
    """Scores regions of jobs from the best query source they have.

    ``shared``: the step's policy, pools, staging and backend (shared.StepShared); ``forward``:
    the forward hooks' context (a recompute pass is routed to its ScoringPass); ``ring``: the
    capture ring or None; ``on_fallback(n)``: windows a recompute had to score instead of the
    ring; ``heads``: this tensor-parallel rank's KV heads among the model's (ScoringPass)."""

    def __init__(
        self,
        shared,
        forward,
        ring,
        on_fallback=None,
        heads: tuple[int, int | None] = (0, None),
    ):
        self.policy, self.parts = shared.policy, shared.parts
        self.staging, self.check = shared.staging, shared.check
        self.heads = heads
        self.forward = forward
        # SGLang builds and runs the recompute forward itself (patches/upstream 0008) where
        # its observers see the queries and the extend writes no K/V (0006, 0007)
        self.backend = shared.backend
        self.sglang_runs_recompute = shared.backend.runs_recompute
        # recompute forwards run, by who built them (/server_info)
        self.forwards = {"sglang": 0, "sgl_kara": 0}
        self.ring = ring
        self.on_fallback = on_fallback

    def scoring_pass(self, jobs, region_slots) -> ScoringPass:
        return ScoringPass(
            self.policy,
            self.parts.keys,
            self.parts.layer_ids,
            region_slots,
            [j.view() for j in jobs],
            [j.region for j in jobs],
            self.heads,
        )

    def score(self, jobs, rows, region_slots, q_lo: list[int], n: int) -> torch.Tensor:
        """[B, L, H_kv, M] scores of the regions by the ``n`` queries of each job from physical
        row ``q_lo[b]``: captured where the ring still holds them, recomputed for the others."""
        if not self.policy.needs_queries:
            return self.scoring_pass(jobs, region_slots).score_without_queries()
        ring = self.ring
        if ring is None:
            return self._recompute_scores(jobs, rows, region_slots, q_lo, n)
        q_starts = [lo + j.state.pos_offset for lo, j in zip(q_lo, jobs)]  # logical
        held = [
            j.state.capture_from is not None
            and s >= j.state.capture_from
            and ring.holds(j.req, j.row)
            and (j.length + j.state.pos_offset) - s <= ring.capacity
            for s, j in zip(q_starts, jobs)
        ]
        # counted once per window: at the span holding its first query (a spread window is
        # scored a span per step; a later span is held whenever the first one is)
        windows = sum(
            not h and lo == j.region.query_start for h, lo, j in zip(held, q_lo, jobs)
        )
        if windows and self.on_fallback is not None:
            self.on_fallback(windows)
        if not any(held):
            return self._recompute_scores(jobs, rows, region_slots, q_lo, n)
        if all(held):
            return self._captured_scores(jobs, rows, region_slots, q_starts, n)
        # Some requests hold their window's queries in the ring, others (no free row, or their
        # queries left it): each part from its own source, in the jobs' order.
        parts = [
            [i for i, h in enumerate(held) if h],
            [i for i, h in enumerate(held) if not h],
        ]
        idx = [self.staging.to_device(p) for p in parts]
        captured = self._captured_scores(
            [jobs[i] for i in parts[0]],
            rows[idx[0]],
            region_slots[idx[0]],
            [q_starts[i] for i in parts[0]],
            n,
        )
        recomputed = self._recompute_scores(
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

    def _chunk(self, n: int) -> int:
        """Jobs per recompute forward or ring read: SGLang's token budget of one forward."""
        return max(1, self.parts.recompute_tokens // max(1, n))

    def _captured_scores(self, jobs, rows, region_slots, q_starts, n) -> torch.Tensor:
        """Scores from the ring's queries (``n`` from logical position ``q_starts[b]``), read
        for at most one forward's token budget of queries at a time."""
        per = self._chunk(n)
        out = []
        for i in range(0, len(jobs), per):
            scoring = self.scoring_pass(jobs[i : i + per], region_slots[i : i + per])
            starts = self.staging.to_device(q_starts[i : i + per])
            ring_rows = self.ring.rows_for(rows[i : i + per])
            for lid in self.parts.layer_ids:
                scoring.score_layer(lid, self.ring.read(lid, ring_rows, starts, n))
            out.append(scoring.result())
        captured = out[0] if len(out) == 1 else torch.cat(out)
        if self.check and not bool(torch.isfinite(captured).all()):
            # the ring is NaN-poisoned in integrity mode
            raise AssertionError(
                "scores from the capture ring are not finite: a window read queries never "
                "written"
            )
        return captured

    def _recompute_scores(self, jobs, rows, region_slots, q_lo, n) -> torch.Tensor:
        """Scores from recompute forwards of at most one forward's token budget each."""
        per = self._chunk(n)
        out = []
        for i in range(0, len(jobs), per):
            sub = jobs[i : i + per]
            scoring = self.scoring_pass(sub, region_slots[i : i + per])
            self._recompute(sub, rows[i : i + per], scoring, q_lo[i : i + per], n)
            if scoring.error is not None:
                raise scoring.error
            out.append(scoring.result())
        return out[0] if len(out) == 1 else torch.cat(out)

    def _recompute(self, jobs, rows, scoring: ScoringPass, q_lo, n: int) -> None:
        """One recompute forward over ``n`` query tokens of each job, feeding ``scoring``."""
        extend, window_slots = extend_rows(
            jobs,
            rows,
            self.parts.req_to_token,
            q_lo,
            n,
            self.staging,
            kv_cached=self.sglang_runs_recompute,
        )
        scoring.positions = extend.positions
        scoring.window_slots = window_slots
        if self.sglang_runs_recompute:
            self.forwards["sglang"] += 1
            with self.forward.scoring_pass(scoring, None):
                self.parts.run_cached_extend(extend)
            return
        self.forwards["sgl_kara"] += 1
        batch = self.backend.recompute_batch(self.parts.scheduler, extend)
        with self.forward.scoring_pass(scoring, batch):
            self.backend.run_eager(self.parts.model_runner, batch, ScoringComplete)
