"""``KARA_RECORD_EVICTIONS=path``: which logical positions each event dropped, per layer and KV head.

A diagnostic for independent references (tests/oracle.py masks exactly these entries in a
Hugging Face forward) and for per-event analysis. One JSON line per compressed request per event:

    {"rid": ..., "event": n, "logical_len": L, "evicted": [[[pos, ...] per kv head] per layer]}

``logical_len`` is the request's logical KV length when the event ran: forwards of positions
>= logical_len no longer see the evicted entries.

Under ``--tp-size T`` each rank holds and compacts its own KV heads, so each rank records them:
rank r writes ``path.tp<r>``, whose records add ``"tp_rank"`` and ``"first_kv_head"`` (the
model's index of the rank's first head); the model's record of an event is the ranks' head
lists concatenated in rank order (tests/oracle.py ``read_evictions``). To name a dropped row's logical position after
earlier compactions (snapkv / streaming re-compress compacted rows), the recorder keeps, per
request, the logical positions of its compacted rows [P, f) per (layer, head), in its
own table (a retraction clears them with the row); rows >= f are uncompressed, so their
logical position is row + pos_offset.
"""

from __future__ import annotations

import json

import torch

from sgl_kara import env
from sgl_kara.scheduler.state import SideTable


class EvictionRecorder:
    def __init__(self, path: str, tp: tuple[int, int] | None = None):
        self.path = path
        self.tp = tp  # (tensor-parallel rank, the model's index of its first KV head)
        self.events = 0
        # per request: [layers, heads, f - P] logical positions of its compacted rows
        self.logical_rows = SideTable(row=True)

    @classmethod
    def from_env(
        cls, tp_rank: int = 0, tp_size: int = 1, first_kv_head: int = 0
    ) -> EvictionRecorder | None:
        path = env.record_evictions()
        if not path:
            return None
        if tp_size > 1:
            return cls(f"{path}.tp{tp_rank}", (tp_rank, first_kv_head))
        return cls(path)

    def region_logical(
        self, state, start: int, region: int, layers: int, heads: int
    ) -> torch.Tensor:
        """[layers, heads, region] logical positions of rows [start, start + region)."""
        rows = torch.arange(start, start + region)
        out = (rows + state.pos_offset).expand(layers, heads, region).clone()
        shadow = self.logical_rows.get(state)
        below = max(
            0, min(state.frontier, start + region) - start
        )  # region rows under the frontier
        if below:
            lo = start - state.protected
            out[..., :below] = shadow[..., lo : lo + below]
        return out

    def prepare(
        self,
        rid,
        state,
        start: int,
        region_len: int,
        kept: torch.Tensor,
        logical_len: int,
    ):
        """kept: [layers, heads, K] indices into the region rows [start, start + region_len); call
        before the request's state advances. Returns what ``commit`` writes once the event commits
        (nothing changes here)."""
        layers, heads, _ = kept.shape
        region = self.region_logical(state, start, region_len, layers, heads)
        kept_pos = torch.gather(region, 2, kept.cpu().to(torch.int64))
        evicted = []
        for layer_id in range(layers):
            evicted.append(
                [
                    sorted(
                        set(region[layer_id, h].tolist())
                        - set(kept_pos[layer_id, h].tolist())
                    )
                    for h in range(heads)
                ]
            )
        shadow = self.logical_rows.get(state)
        head = (
            shadow[..., : start - state.protected]
            if shadow is not None
            else torch.empty(layers, heads, 0, dtype=torch.int64)
        )
        return rid, logical_len, evicted, torch.cat([head, kept_pos], dim=2)

    def commit(self, state, prepared) -> None:
        rid, logical_len, evicted, logical_rows = prepared
        self.logical_rows.set(state, logical_rows)
        self.events += 1
        record = {
            "rid": rid,
            "event": self.events,
            "logical_len": logical_len,
            "evicted": evicted,
        }
        if self.tp is not None:
            record["tp_rank"], record["first_kv_head"] = self.tp
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
