"""Admission by compressed footprint.

SGLang's PrefillAdder reserves, for every running and new request, the tokens it may still
generate (``max_new_tokens - len(output_ids)``, times a ratio), on top of what the running ones
already hold. Under compression a request that generates G more tokens holds at most
``schedule.footprint(G)`` of them (Kara: about ``G * K / (W - U) + W + period``; threshold
policies: at most C_max + 1), under its own ``custom_params.kara`` overrides, and its KV grows
by at most ``schedule.growth(G, row)`` beyond what its row holds (Kara: ``G * K / (W - U)`` plus
the part of a window and a period its uncompressed tail has still to fill, at the rate that
tail is not compressed). Both a running request and one being admitted are charged that growth
(the latter of the row its prefill leaves: its prompt, nothing compressible yet), so a
request's count in SGLang's accounting -- what it holds plus its charge -- does not shrink once
it runs: room freed that way would wait for a request to leave, since SGLang's prefill does not
look at the waiting queue again until then. Without this discount the freed memory would never
admit more requests and compression would buy no throughput.

``charge(req, running)`` (the runtime's) is the ``max_new_tokens`` admission counts for a request:
its output so far plus what its KV may still grow by (None: compression off for it, SGLang's own
count applies). With the upstream series SGLang asks for it (``PrefillAdder.reserved_new_tokens``,
patches/upstream 0010); on plain SGLang it is presented as the request's ``max_new_tokens`` for
the duration of SGLang's own accounting only.
"""

from __future__ import annotations

import contextlib

from sgl_kara import backends


def make_prefill_adder(base, charge, asks: bool = False):
    """SGLang's prefill adder ``base`` charging each request ``charge(req, running)``: through
    its ``reserved_new_tokens`` where SGLang asks for it (``asks``: the series' 0010), else by
    presenting the charge as ``max_new_tokens`` around its two accounting calls."""
    if asks:

        class KaraReservingAdder(base):
            def reserved_new_tokens(self, req, running):
                value = charge(req, running)
                if value is None:
                    return super().reserved_new_tokens(req, running)
                return value

        KaraReservingAdder.__name__ = f"Kara{base.__name__}"
        return KaraReservingAdder

    class KaraPrefillAdder(base):
        def _get_running_request_total_token_offset(self, req):
            with presented(req, charge, running=True):
                return super()._get_running_request_total_token_offset(req)

        def add_one_req(self, req, *args, **kwargs):
            with presented(req, charge, running=False):
                return super().add_one_req(req, *args, **kwargs)

    KaraPrefillAdder.__name__ = f"Kara{base.__name__}"
    return KaraPrefillAdder


@contextlib.contextmanager
def presented(req, charge, running: bool):
    """``req``'s max_new_tokens is ``charge(req, running)`` for the duration (unchanged when
    None)."""
    value = charge(req, running)
    if value is None:
        yield
        return
    with backends.current().max_new_tokens_as(req, value):
        yield
