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
    """Recent decode queries of the running requests, for scoring without a recompute forward.

    Sized by the running-request limit, not by request slots, and allocated at construction:

        buffers[layer]  [rows + 1, capacity, H_q, D]   row ``rows`` is a trash row: requests
                                                        holding no ring row write there
        row_of          [req_slots] int64 (device)     ring row of each req_to_token row
        query of logical position p of a request -> buffers[l][row_of[req_pool_idx], p % capacity]

    Rows are handed out at a request's decode steps (``assign``) and taken back when it leaves
    the running batch (``sweep``); ``owner`` (host) is the one record of who holds which row.
    """

    def __init__(self, layers: dict[int, tuple[int, int]], rows: int, capacity: int, req_slots: int, dtype, device):
        """layers: layer_id -> (H_q, D)."""
        self.rows = rows
        self.capacity = capacity
        self.buffers = {
            lid: torch.zeros((rows + 1, capacity, hq, d), dtype=dtype, device=device) for lid, (hq, d) in layers.items()
        }
        self.row_of = torch.full((req_slots,), rows, dtype=torch.int64, device=device)
        self.owner: dict[int, tuple[int, object]] = {}  # req_pool_idx -> (ring row, request)
        self.free_rows = list(range(rows - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def holds(self, req) -> bool:
        held = self.owner.get(req.kv.req_pool_idx)
        return held is not None and held[1] is req

    def assign(self, req) -> bool:
        """Give ``req`` a ring row (True), or False when every row is held."""
        idx = req.kv.req_pool_idx
        held = self.owner.get(idx)
        if held is not None:  # the slot's previous request finished between sweeps: take over
            self.owner[idx] = (held[0], req)
            return True
        if not self.free_rows:
            return False
        row = self.free_rows.pop()
        self.owner[idx] = (row, req)
        self.row_of[idx] = row
        return True

    def sweep(self, running_slots: set[int]) -> None:
        """Take back the rows of requests no longer running (finished, aborted, retracted)."""
        for idx in [i for i in self.owner if i not in running_slots]:
            row, _ = self.owner.pop(idx)
            self.row_of[idx] = self.rows
            self.free_rows.append(row)

    def check(self) -> None:
        """Integrity: every row is free xor owned once, and row_of agrees with owner."""
        owned = [row for row, _ in self.owner.values()]
        if sorted(owned + self.free_rows) != list(range(self.rows)):
            raise AssertionError(f"query ring rows inconsistent: owned {sorted(owned)} free {sorted(self.free_rows)}")
        for idx, (row, _) in self.owner.items():
            if int(self.row_of[idx]) != row:
                raise AssertionError(f"query ring row_of[{idx}] = {int(self.row_of[idx])}, owner says {row}")

    def rows_for(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return self.row_of[req_pool_indices]

    def write(self, layer_id: int, q: torch.Tensor, ring_rows: torch.Tensor, positions: torch.Tensor) -> None:
        """q: [T, H_q, D] queries of T decode tokens; ring_rows (from ``rows_for``) / positions: [T]."""
        self.buffers[layer_id][ring_rows, positions % self.capacity] = q

    def read(self, layer_id: int, ring_rows: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Queries of logical positions [start_b, start_b + length) -> [B, length, H_q, D]."""
        buf = self.buffers[layer_id]
        pos = (starts[:, None] + torch.arange(length, device=starts.device)[None, :]) % self.capacity
        return buf[ring_rows[:, None], pos]
