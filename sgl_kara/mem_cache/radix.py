"""KaraRadixCache: SGLang's UnifiedRadixCache that never inserts compressed KV.

A compressed request's row holds, past its protected prefix P, entries that no longer match
the token ids 1:1. Inserting them under the original token ids would give later requests
stale KV (and the tree would free slots that the row still names). Every checkpoint is
therefore capped at the request's exact (uncompressed) length (``insert_cap``); the rest of the
row is freed by SGLang's own release path. Registered as ``--radix-cache-backend kara``.
Reads the request's Kara state (``state_of``: the scheduler runtime's table) and lengths only.
"""

from __future__ import annotations

from sgl_kara import _sglang as adapter
from sgl_kara._sglang import UnifiedRadixCache, create_unified_radix_cache
from sgl_kara.process import STATE

BACKEND_NAME = "kara"


def insert_cap(req, state) -> int | None:
    """How much of the row the radix tree may take (None = all of it).

    A compressed row is exact only up to its protected prefix. A row re-prefilled after a
    retraction is exact, but while it runs its generated part must stay its own: inserted,
    those tokens would become a protected shared prefix that Kara never compresses again, and
    the request would hold its full length until it finishes. A finished uncompressed request
    inserts everything (later requests with the same history hit it).
    """
    if state is None:
        return None
    if state.compressions > 0:
        return state.protected
    if state.enabled and adapter.output_length(req) and not adapter.finished(req):
        return len(adapter.prompt_ids(req))
    return None


class KaraRadixCache(UnifiedRadixCache):
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        runtime = (
            STATE.runtime
        )  # this scheduler's Kara runtime: its table holds the state
        cap = insert_cap(req, None if runtime is None else runtime.table.get(req))
        if cap is not None:
            up_to = min(up_to, max(cap, adapter.tree_prefix_length(req)))
        return super().checkpoint(req, up_to=up_to, **kwargs)


def kara_radix_cache_factory(ctx):
    return create_unified_radix_cache(ctx, cache_class=KaraRadixCache)
