"""Admission by compressed footprint.

SGLang's PrefillAdder reserves, for every running and new request, the tokens it may still
generate (``max_new_tokens - len(output_ids)``, times a ratio). Under Kara a request that
generates G more tokens holds only about ``G * K / (W - U) + W + period`` of them (each
window of W - U new tokens shrinks to K entries; the uncompressed tail is at most a window
plus the tokens decoded while waiting for the next event). Without this discount the freed
memory would never admit more requests and compression would buy no throughput.
"""

from __future__ import annotations

import math

from sgl_kara.policies.kara import kept_count


def compressed_future_tokens(remaining: int, runtime, state=None) -> int:
    """Tokens a request that may still generate ``remaining`` will hold, under its own options
    (``custom_params.kara`` retention / budget override the server's config)."""
    cfg = runtime.cfg
    if remaining <= 0:
        return remaining
    if cfg.policy in ("snapkv", "streaming"):
        budget = state.budget if state is not None and state.budget is not None else cfg.snapkv_budget
        return min(remaining, budget + (cfg.snapkv_threshold - cfg.snapkv_budget) + 1)
    if cfg.policy != "kara":
        return remaining
    retention = state.retention if state is not None and state.retention is not None else cfg.retention
    rate = kept_count(cfg.compressible, retention) / cfg.compressible
    return min(remaining, math.ceil(remaining * rate) + cfg.window + cfg.period)


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
        self.params.max_new_tokens = self.done + compressed_future_tokens(remaining, self.runtime, state)

    def __exit__(self, *exc):
        self.params.max_new_tokens = self.orig
        return False


