"""Window queries for scoring: a capture ring filled during decode, or a recompute forward.

Both end in the same per-layer call, ``score_layer(layer_id, q)``, with ``q`` of shape
``[B, W_q, H_q, D]`` (W_q = W for bidirectional scoring, U for the buffer-only ablation), which
scores the region's keys read through the requests' slot indices (kernels.window_score).
"""

from __future__ import annotations

import torch

from sgl_kara.kernels.window_score import window_scores_paged


class ScoringPass:
    """Collects ``[B, L, H_kv, M]`` scores for one batch of requests, one layer at a time.

    ``region_slots``: ``[B, M]`` pool slots of the keys to score. ``query_rows``: which of the
    W window queries to use (``slice(None)`` all, ``slice(-U, None)`` buffer only).
    """

    def __init__(self, kv_pool, layer_ids: list[int], region_slots: torch.Tensor, query_rows: slice):
        self.kv_pool = kv_pool
        self.layer_index = {lid: i for i, lid in enumerate(layer_ids)}
        self.region_slots = region_slots
        self.query_rows = query_rows
        B, M = region_slots.shape
        self.scores: torch.Tensor | None = None
        self.B, self.M = B, M
        self.seen: set[int] = set()
        # Set for a recompute forward: logical positions of the window tokens, [B * W].
        self.positions: torch.Tensor | None = None

    def score_layer(self, layer_id: int, q: torch.Tensor) -> None:
        """q: [B, W, H_q, D] window queries of this layer (post-RoPE)."""
        q = q[:, self.query_rows].contiguous()
        k_buffer = self.kv_pool.get_key_buffer(layer_id)
        s = window_scores_paged(q, k_buffer, self.region_slots)  # [B, H_kv, M]
        if self.scores is None:
            self.scores = torch.zeros(
                (self.B, len(self.layer_index), s.shape[1], self.M), dtype=torch.float32, device=s.device
            )
        self.scores[:, self.layer_index[layer_id]] = s
        self.seen.add(layer_id)

    def result(self) -> torch.Tensor:
        missing = set(self.layer_index) - self.seen
        if missing:
            raise RuntimeError(f"scoring pass saw no queries for layers {sorted(missing)}")
        return self.scores


class QueryRing:
    """Per-request ring of recent queries, indexed [req_pool_idx, logical_pos % R] per layer.

    Memory: rows * R * H_q * D values per layer, allocated on first write of each layer.
    """

    def __init__(self, num_rows: int, capacity: int):
        self.num_rows = num_rows
        self.capacity = capacity
        self.buffers: dict[int, torch.Tensor] = {}

    def write(self, layer_id: int, q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """q: [T, H_q, D] queries of T decode tokens; rows/positions: [T] int64."""
        buf = self.buffers.get(layer_id)
        if buf is None:
            buf = torch.zeros((self.num_rows, self.capacity, *q.shape[1:]), dtype=q.dtype, device=q.device)
            self.buffers[layer_id] = buf
        buf[rows, positions % self.capacity] = q

    def read(self, layer_id: int, rows: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Queries of logical positions [start_b, start_b + length) -> [B, length, H_q, D]."""
        buf = self.buffers[layer_id]
        pos = (starts[:, None] + torch.arange(length, device=starts.device)[None, :]) % self.capacity
        return buf[rows[:, None], pos]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
