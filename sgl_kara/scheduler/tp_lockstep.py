"""Tensor-parallel ranks in lockstep: what one rank's Kara runtime must agree on with the others.

Under ``--tp-size T`` every rank runs the same Kara runtime on its own KV heads, and everything
that names a slot or a length is computed from replicated state, so every rank plans the same
events with no communication (docs/TENSOR_PARALLEL.md). Two things here keep it so:

``FailureAgreement`` (always on under TP): an event's chunk, or a spread step's group, that
fails on one rank only (device memory, a kernel error) must fail on every rank, or one rank
rewrites a row the others leave as it was. Before a chunk commits, the ranks all-reduce one flag
per rank over SGLang's TP CPU group: a chunk failed anywhere is undone everywhere, and the retry
that finds the failing request runs alike on every rank. A failure of Kara's scoring inside a
recompute forward is held until every rank has left the forward at the same layer
(scheduler/forward.py), then agreed on like any other; a failure of SGLang's own code inside
that forward on one rank is outside what it can agree on (SGLang's own forwards have the same
limit: the rank's scheduler process ends, and the server with it).

``PlanDigest`` (``KARA_CHECK_TP_PLAN=1``; on in every TP test) verifies the lockstep while
serving: each rank folds what it is about to run into a running digest -- the requests,
regions, keep counts and fresh slots of every event, the spread steps' chunks -- and, at
the end of the decode step, the replicated state the step left: each running request's lengths,
P, f, offset, compressions, capture start and its row's slot indices. The ranks all-gather the
digest (one int64 each, the TP CPU group) before any work that may enter a collective (an event
or a spread step, whose recompute forward all-reduces) and once at the end of every decode step,
events or not. Every rank therefore gathers at the same points for as long as the plans agree,
and the first gather after a divergence sees it on every rank at once: each rank raises
``PlanDivergence`` naming the first rank whose digest differs from the majority's (rank 0's on a
tie), SGLang's scheduler stops the server, and no rank is left waiting in a collective the
others never enter.

``KARA_INJECT_TP_DIVERGENCE`` (tests, sgl_kara/diagnostics/faults.py) makes one rank's plan
differ, a real divergence the check must stop.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import torch

from sgl_kara import _sglang as adapter
from sgl_kara import env

logger = logging.getLogger(__name__)


class PlanDivergence(RuntimeError):
    """Tensor-parallel ranks planned different Kara work: the server must stop."""


class PeerFailed(RuntimeError):
    """This rank's chunk succeeded, another rank's failed: undone here too."""


class FailureAgreement:
    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self.group = rank, size, group

    def failed_ranks(self, failed: bool) -> list[int]:
        """All-reduce one flag per rank (this one's: ``failed``); the ranks that failed."""
        flags = torch.zeros(self.size, dtype=torch.int64)
        flags[self.rank] = int(failed)
        torch.distributed.all_reduce(flags, group=self.group)
        return [r for r in range(self.size) if flags[r]]

    def check(self) -> None:
        """This rank's chunk is ready to commit: raise PeerFailed if another rank's failed."""
        failed = self.failed_ranks(False)
        if failed:
            raise PeerFailed(
                f"failed on tensor-parallel rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))}"
            )


class PlanDigest:
    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self.group = rank, size, group
        self.hash = hashlib.blake2b(digest_size=8)
        self.gathers = 0

    @classmethod
    def from_env(cls, rank: int, size: int, group) -> PlanDigest | None:
        """The check where ``KARA_CHECK_TP_PLAN`` asks for it and there are several ranks."""
        if size <= 1 or not env.check_tp_plan():
            return None
        logger.info("sgl_kara: TP plan check on (rank %d of %d)", rank, size)
        return cls(rank, size, group)

    # ------------------------------------------------------------------ what is folded in
    def fold(self, *items) -> None:
        self.hash.update(repr(items).encode())

    def planned(self, jobs: list, page_size: int) -> list:
        """The jobs (plan.Job) an event is about to run: folded in; returned as it runs them."""
        self.fold(
            "event",
            [
                (
                    str(adapter.rid(j.req)),
                    j.index,
                    j.region.start,
                    j.region.length,
                    j.region.keep,
                    j.region.query_start,
                    j.region.query_len,
                    j.fresh_slots(page_size),
                )
                for j in jobs
            ],
        )
        return jobs

    def spread(self, chunks: list) -> None:
        """A spread step's chunks [(job, n)]."""
        self.fold(
            "spread",
            [
                (str(adapter.rid(j.req)), j.region.start, j.region.query_start, n)
                for j, n in chunks
            ],
        )

    def step_state(self, reqs, table, req_to_token: torch.Tensor) -> None:
        """The replicated state a decode step leaves: per running request its length, whether
        its rows are settled, P, f, offset, compressions, capture start and the slots its row
        names (``table``: state.RequestTable)."""
        rows = []
        for req in reqs:
            s = table.get(req)
            length = adapter.kv_length(req)
            slots = req_to_token[adapter.row_index(req), :length].cpu()
            rows.append(
                (
                    str(adapter.rid(req)),
                    length,
                    adapter.kv_settled(req),
                    None
                    if s is None
                    else (
                        s.protected,
                        s.frontier,
                        s.pos_offset,
                        s.compressions,
                        s.capture_from,
                    ),
                    hashlib.blake2b(slots.numpy().tobytes(), digest_size=8).hexdigest(),
                )
            )
        self.fold("state", rows)

    # ------------------------------------------------------------------ the gather
    def value(self) -> int:
        return int.from_bytes(self.hash.digest(), "little", signed=True)

    def check(self, step: int, where: str) -> None:
        """All-gather the digest over the TP CPU group; raise PlanDivergence on every rank when
        one differs. ``where``: "event" (before work that enters a collective) or "step" (the
        decode step's end)."""
        self.gathers += 1
        mine = torch.tensor([self.value()], dtype=torch.int64)
        digests = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(digests, mine, group=self.group)
        values = [int(d) for d in digests]
        odd = first_divergent(values)
        if odd is not None:
            reference = next(r for r, v in enumerate(values) if v != values[odd])
            raise PlanDivergence(
                f"Kara's tensor-parallel ranks diverged at decode step {step} (before "
                f"{'an event' if where == 'event' else 'the step ended'}): TP rank {odd}'s "
                f"plan differs from TP rank {reference}'s (digests by rank: "
                f"{', '.join(f'{v & 0xFFFFFFFFFFFFFFFF:016x}' for v in values)}); "
                "stopping the server (KARA_CHECK_TP_PLAN)"
            )


def first_divergent(values: list[int]) -> int | None:
    """The first rank whose value differs from the majority's (rank 0's on a tie); None when
    all agree."""
    if len(set(values)) <= 1:
        return None
    counts = Counter(values)
    top = max(counts.values())
    reference = next(v for v in values if counts[v] == top)
    return next(r for r, v in enumerate(values) if v != reference)
