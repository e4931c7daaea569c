"""Which running requests give their KV back first when the pool runs short, and what Kara does
with a request SGLang retracted.

Retract uncompressed requests first (Zipage §4.4): a compressed request holds few rows for its
tokens, and retracting it loses its compressions (it is re-prefilled from its tokens, exact).
Among uncompressed requests, those already retracted more often are kept first: a request just
re-prefilled is uncompressed again until its catch-up compression and would otherwise be
retracted again and again while the others never are.

Reached through SGLang's retraction-policy registry where it has one (patches/upstream 0005:
``kara-<base>`` for each policy SGLang registered, e.g. ``kara-length``: the base's order made
Kara's, and the retract callback; the start-up selects ``kara-<the user's
--retraction-policy>``), else through the plugin's hooks on
``ScheduleBatch._get_decode_retraction_order`` and ``Req.reset_for_retract`` (plugin.py).
"""

from __future__ import annotations

from sgl_kara import _sglang as adapter
from sgl_kara.backends import RETRACTION_PREFIX, retraction_policy_name
from sgl_kara.process import STATE


def kara_order(order: list[int], reqs) -> list[int]:
    """SGLang's retraction order (indices into ``reqs``, kept first; retraction pops from the
    end) made Kara's: compressed requests kept first, then the uncompressed ones, those
    retracted most often first (stable). Unchanged without a Kara runtime."""
    rt = STATE.runtime  # this scheduler process's Kara runtime (None: plain SGLang)
    if rt is None:
        return order
    states = [rt.table.get(r) for r in reqs]
    compressed = [i for i in order if states[i] is not None and states[i].compressions]
    done = set(compressed)
    plain = [i for i in order if i not in done]
    plain.sort(key=lambda i: -(states[i].retractions if states[i] else 0))  # stable
    return compressed + plain


def on_retract(req) -> None:
    """SGLang reset ``req`` for re-prefill: its rows are exact again."""
    rt = STATE.runtime  # this scheduler process's Kara runtime (None: plain SGLang)
    if rt is not None:
        rt.on_retract(req)


def register_policy() -> None:
    """``kara-<base>`` in SGLang's retraction-policy registry for every policy registered there
    (where it has one): ``base``'s order made Kara's, and the retract callback."""
    base_class = adapter.retraction_policy_base()

    class KaraRetractionPolicy(base_class):
        def __init__(self, base: str):
            self.base = base

        def get_retraction_order(self, reqs):
            order = adapter.retraction_policy(self.base).get_retraction_order(reqs)
            return kara_order(order, reqs)

        def on_retract(self, req):
            on_retract(req)

    registered = adapter.registered_retraction_policies()
    for base in registered:
        if not base.startswith(RETRACTION_PREFIX) and (
            retraction_policy_name(base) not in registered
        ):
            adapter.register_retraction_policy(
                retraction_policy_name(base), KaraRetractionPolicy(base)
            )
