"""Random baseline: Kara's windows and schedule, with the kept entries drawn uniformly at random.

Idea
    The floor any scoring must beat: every ``period`` decode steps, a request's oldest complete
    window [f, f + W) (followed by ``recent`` newer tokens) has its first W - U rows compressed
    to K = ceil(r (W - U)) entries chosen uniformly at random, independently per layer and KV
    head. Same region, schedule and footprint as Kara, so budgets are equal by construction; no
    queries are read, so there is no capture ring and no recompute forward.

Reproducibility
    The draw of one event is seeded by (``seed``, the layer, the window's first logical
    position): the same request decoded twice keeps the same entries, and a window's draw does
    not depend on which other requests share its event (requests at the same positions draw the
    same pattern) nor on how the KV heads are split over tensor-parallel ranks (a rank takes
    its heads' rows of the draw for all the model's heads).

Parameters (flags --kara-random-<name>): window, buffer, retention, period, recent as Kara's
(W, U, r, delta, R; same defaults), and ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Region, RowView, ScoreInput, need, register, top_k
from .kara import KaraPolicy, WindowOptions, kept_count, request_retention


@dataclass(frozen=True)
class RandomOptions(WindowOptions):
    seed: int = field(
        default=0, metadata={"help": "seed of the random draws (reproducible runs)"}
    )

    def __post_init__(self):
        super().__post_init__()
        need(
            0 <= self.seed < 2**63,
            "seed",
            "must be an integer in [0, 2**63)",
            self.seed,
        )


def random_scores(
    seed: int, layer: int, start: int, heads: int, m: int
) -> torch.Tensor:
    """[heads, m] float32 uniform draws for the window whose first logical position is
    ``start``; their top-K is a uniformly random K-subset per head."""
    g = torch.Generator().manual_seed(hash((seed, layer, start)) & (2**63 - 1))
    return torch.rand(heads, m, generator=g)


@register
class RandomPolicy(KaraPolicy):
    name = "random"
    prefix = "random_"
    Options = RandomOptions
    needs_queries = False

    def region(self, row: RowView) -> Region | None:
        o = self.options
        if row.length - row.frontier < o.window + o.recent:
            return None
        keep = kept_count(o.compressible, request_retention(o, row.state))
        return Region(row.frontier, o.compressible, keep)

    def score(self, inp: ScoreInput) -> torch.Tensor:
        heads, m = inp.k_buffer.shape[1], inp.slots.shape[1]
        first = inp.head_offset
        draws = [
            random_scores(
                self.options.seed,
                inp.layer,
                reg.start + row.pos_offset,
                inp.model_heads or heads,
                m,
            )[first : first + heads]
            for row, reg in zip(inp.rows, inp.regions)
        ]
        return torch.stack(draws).to(inp.slots.device)

    def select(self, scores: torch.Tensor, keep: int) -> torch.Tensor:
        """The top ``keep`` of the draws (no Token2Chunk: chunks of random scores mean
        nothing)."""
        return top_k(scores, keep)
