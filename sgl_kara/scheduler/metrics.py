"""Prometheus metrics for compression events, served on SGLang's /metrics (--enable-metrics).

Created in the scheduler process after SGLang has set up prometheus_client's multiprocess
directory, like SGLang's own scheduler metrics.
"""

from __future__ import annotations


class KaraMetrics:
    def __init__(self):
        from prometheus_client import Counter

        self.events = Counter(
            "sglang:kara_events_total", "Kara compression events run."
        )
        self.requests = Counter(
            "sglang:kara_requests_compressed_total", "Request windows compressed."
        )
        self.dropped = Counter(
            "sglang:kara_tokens_dropped_total", "KV entries dropped by compression."
        )
        self.seconds = Counter(
            "sglang:kara_compression_seconds_total",
            "Wall time spent in compression events (attempts that found no free slots included).",
        )
        self.fallbacks = Counter(
            "sglang:kara_recompute_fallbacks_total",
            "Windows scored by recompute because captured queries were gone.",
        )
        self.deferred = Counter(
            "sglang:kara_deferred_events_total",
            "Due events not run because memory did not bind (--kara-trigger pressure / headroom).",
        )

    def record_event(self, requests: int, dropped: int) -> None:
        self.events.inc()
        self.requests.inc(requests)
        self.dropped.inc(dropped)
