"""The capture ring: recent decode queries of the running requests, for scoring a window without a
recompute forward, and its allocation at start-up within the memory planned for it."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def make_ring(parts, cfg, capacity: int, poison: bool = False) -> QueryRing:
    """The capture ring, allocated now (start-up), one row per request that can run at once
    (model_shape.ring_rows: the request limit, bounded by what the pool holds and by
    ``--kara-query-ring-rows``). Its memory was planned before the model loaded: on CUDA taken
    from the KV pool's share of the GPU (startup.reserve_device_memory), so the ring must not
    outgrow that plan; on CPU counted in the RAM check, and it must fit in the memory the KV
    pool left. Refused, naming the flags, otherwise. ``parts``: _sglang.SchedulerParts."""
    from sgl_kara.memory_plan import available_ram_bytes, gib
    from sgl_kara.model_shape import ring_bytes, ring_rows
    from sgl_kara.startup import UnsupportedFeature, planned_ring_rows

    layers = {lid: (parts.q_heads, parts.head_dim) for lid in parts.layer_ids}
    running = parts.max_running
    rows = ring_rows(running, parts.pool_tokens, capacity, cfg.query_ring_rows)
    device, dtype = parts.req_to_token.device, parts.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = ring_bytes(rows, capacity, layers.values(), itemsize)
    flags = (
        "use --kara-query-source recompute, or lower --kara-query-ring-rows / "
        "--max-running-requests / --kara-window / --kara-period / --max-total-tokens"
    )
    if device.type == "cuda":
        planned_rows = planned_ring_rows(parts.server_args, cfg)
        planned = ring_bytes(planned_rows, capacity, layers.values(), itemsize)
        if need > planned:
            raise UnsupportedFeature(
                f"the capture query ring needs {gib(need)} ({rows} rows: one per running "
                f"request, --max-running-requests {running}, bounded by the KV pool and "
                f"--kara-query-ring-rows) but {gib(planned)} ({planned_rows} rows) was taken "
                f"from the KV pool at start-up: {flags}"
            )
    else:
        free = available_ram_bytes()
        if need > 0.9 * free:
            raise UnsupportedFeature(
                f"the capture query ring needs {gib(need)} ({rows} rows: one per running "
                f"request, --max-running-requests {running}, bounded by the KV pool and "
                f"--kara-query-ring-rows; x {capacity} queries: the policy's window and "
                f"period; x {len(layers)} layers) but only {gib(free)} of RAM is free after "
                f"the KV pool: {flags}"
            )
    ring = QueryRing(
        layers,
        rows,
        capacity,
        parts.req_to_token.shape[0],
        dtype,
        device,
        poison=poison,
    )
    logger.info(
        "sgl_kara: capture query ring allocated: %d rows x %d queries x %d layers, %s",
        rows,
        capacity,
        len(layers),
        gib(ring.nbytes),
    )
    return ring


class QueryRing:
    """Recent decode queries of the running requests, for scoring without a recompute forward.

    Sized by the running-request limit, not by request slots, and allocated at construction:

        buffers[layer]  [rows + 1, capacity, H_q, D]   row ``rows`` is a trash row: requests
                                                        holding no ring row write there
        row_of          [req_slots] int64 (device)     ring row of each req_to_token row
        query of logical position p of a request -> buffers[l][row_of[its row], p % capacity]

    Rows are handed out at a request's decode steps (``assign``) and taken back when it leaves
    the running batch (``sweep``); ``owner`` (host) is the one record of who holds which row.

    The buffers are left unwritten (``torch.empty``): a window is read only from positions its
    request wrote (events check ``capture_from`` and the capacity), so on CPU a row's pages become
    resident only once a request writes them, and rows are reused last-in first-out, so the
    resident ring follows the requests that actually ran at once rather than the row count
    (``--max-running 32`` sized 32 rows where at most 11 ran). ``poison`` (integrity
    mode) fills them with NaN instead, so a read of an unwritten query would turn the scores NaN.
    """

    def __init__(
        self,
        layers: dict[int, tuple[int, int]],
        rows: int,
        capacity: int,
        req_slots: int,
        dtype,
        device,
        poison: bool = False,
    ):
        """layers: layer_id -> (H_q, D)."""
        self.rows = rows
        self.capacity = capacity
        self.buffers = {
            lid: torch.empty((rows + 1, capacity, hq, d), dtype=dtype, device=device)
            for lid, (hq, d) in layers.items()
        }
        if poison:
            for b in self.buffers.values():
                b.fill_(float("nan"))
        self.row_of = torch.full((req_slots,), rows, dtype=torch.int64, device=device)
        self.owner: dict[
            int, tuple[int, object]
        ] = {}  # req_pool_idx -> (ring row, request)
        self.free_rows = list(range(rows - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def holds(self, req, idx: int) -> bool:
        """Does ``req`` (in request row ``idx``) hold a ring row?"""
        held = self.owner.get(idx)
        return held is not None and held[1] is req

    def assign(self, req, idx: int) -> bool:
        """Give ``req`` (in request row ``idx``) a ring row (True), or False when every row is
        held."""
        held = self.owner.get(idx)
        if (
            held is not None
        ):  # the slot's previous request finished between sweeps: take over
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
            raise AssertionError(
                f"query ring rows inconsistent: owned {sorted(owned)} free {sorted(self.free_rows)}"
            )
        for idx, (row, _) in self.owner.items():
            if int(self.row_of[idx]) != row:
                raise AssertionError(
                    f"query ring row_of[{idx}] = {int(self.row_of[idx])}, owner says {row}"
                )

    def rows_for(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return self.row_of[req_pool_indices]

    def write(
        self,
        layer_id: int,
        q: torch.Tensor,
        ring_rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """q: [T, H_q, D] queries of T decode tokens; ring_rows (from ``rows_for``) / positions: [T]."""
        self.buffers[layer_id][ring_rows, positions % self.capacity] = q

    def read(
        self, layer_id: int, ring_rows: torch.Tensor, starts: torch.Tensor, length: int
    ) -> torch.Tensor:
        """Queries of logical positions [start_b, start_b + length) -> [B, length, H_q, D]."""
        buf = self.buffers[layer_id]
        pos = (
            starts[:, None] + torch.arange(length, device=starts.device)[None, :]
        ) % self.capacity
        return buf[ring_rows[:, None], pos]
