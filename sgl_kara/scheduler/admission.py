"""Admission by compressed footprint.

SGLang's PrefillAdder reserves, for every running and new request, the tokens it may still
generate (``max_new_tokens - len(output_ids)``, times a ratio). Under compression a request
that generates G more tokens holds only ``policy.footprint(G)`` of them (Kara: about
``G * K / (W - U) + W + period``; threshold policies: at most C_max + 1), under its own
``custom_params.kara`` overrides. Without this discount the freed memory would never admit more
requests and compression would buy no throughput.
"""

from __future__ import annotations


def compressed_future_tokens(remaining: int, runtime, state=None) -> int:
    """Tokens a request that may still generate ``remaining`` will hold (the runtime's
    ``footprint``: the policy's, plus what a capped spread may leave uncompressed)."""
    return runtime.footprint(remaining, state)


def make_prefill_adder(base, runtime):
    class KaraPrefillAdder(base):
        def _get_running_request_total_token_offset(self, req):
            state = runtime.state_of(req)
            if not state.enabled:
                return super()._get_running_request_total_token_offset(req)
            with _discounted(req, runtime):
                return super()._get_running_request_total_token_offset(req)

        def add_one_req(self, req, *args, **kwargs):
            if not runtime.state_of(req).enabled:
                return super().add_one_req(req, *args, **kwargs)
            with _discounted(req, runtime):
                return super().add_one_req(req, *args, **kwargs)

    KaraPrefillAdder.__name__ = f"Kara{base.__name__}"
    return KaraPrefillAdder


class _discounted:
    """Temporarily present max_new_tokens as the compressed footprint of what remains."""

    def __init__(self, req, runtime):
        self.req = req
        self.params = req.sampling_params
        self.done = len(req.output_ids)
        self.runtime = runtime

    def __enter__(self):
        self.orig = self.params.max_new_tokens
        remaining = max(0, self.orig - self.done)
        state = self.runtime.state_of(self.req)
        self.params.max_new_tokens = self.done + compressed_future_tokens(
            remaining, self.runtime, state
        )

    def __exit__(self, *exc):
        self.params.max_new_tokens = self.orig
        return False
