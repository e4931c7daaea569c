"""KaraRadixCache: SGLang's UnifiedRadixCache that never inserts compressed KV.

A compressed request's row holds, past its protected prefix P, entries that no longer match
the token ids 1:1. Inserting them under the original token ids would give later requests
stale KV (and the tree would free slots that the row still names). Every checkpoint is
therefore capped at the request's exact (uncompressed) length; the rest of the row is freed
by SGLang's own release path. A running request re-prefilled after a retraction inserts only its
prompt, so its generated part stays compressible (``KaraRuntime.insert_cap``). Registered as ``--radix-cache-backend kara``.
"""

from __future__ import annotations

from sgl_kara._sglang import UnifiedRadixCache, create_unified_radix_cache
from sgl_kara.scheduler import runtime as rt

BACKEND_NAME = "kara"


class KaraRadixCache(UnifiedRadixCache):
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        active = rt.ACTIVE
        if active is not None:
            cap = active.insert_cap(req)
            if cap is not None:
                up_to = min(up_to, max(cap, int(req.kv.cache_protected_len)))
        return super().checkpoint(req, up_to=up_to, **kwargs)


def kara_radix_cache_factory(ctx):
    return create_unified_radix_cache(ctx, cache_class=KaraRadixCache)
