"""Serving metrics, exported by Ray's metrics agent to Prometheus (names get Ray's `ray_` prefix).

Ray Serve already exports per-deployment request counts and latencies; these add what only the
engine knows: τ, decode tokens/s, generated tokens, time to first token, and per-endpoint latency
including streaming (Serve measures a streaming response until its generator is set up).
"""

from __future__ import annotations

from ray.serve import metrics

_LATENCY_S = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]
_TAU = [1.0, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 12, 16]
_TOKENS_PER_S = [1, 2, 5, 10, 15, 20, 30, 50, 100, 200, 500, 1000]


class ServingMetrics:
    """One set per replica; tags: endpoint (completions / chat), status (HTTP code), speculative."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "jetflow_requests", description="requests answered, by endpoint and HTTP status",
            tag_keys=("endpoint", "status"))
        self.latency = metrics.Histogram(
            "jetflow_request_latency_s", description="request latency until the last byte, seconds",
            boundaries=_LATENCY_S, tag_keys=("endpoint",))
        self.first_token = metrics.Histogram(
            "jetflow_time_to_first_token_s", description="arrival to first streamed text, seconds",
            boundaries=_LATENCY_S, tag_keys=("endpoint",))
        self.tau = metrics.Histogram(
            "jetflow_tau", description="tokens committed per target verify forward (bonus included), per request",
            boundaries=_TAU, tag_keys=("speculative",))
        self.tokens_per_s = metrics.Histogram(
            "jetflow_decode_tokens_per_s", description="decode throughput per request, prefill excluded",
            boundaries=_TOKENS_PER_S, tag_keys=("speculative",))
        self.generated = metrics.Counter(
            "jetflow_generated_tokens", description="completion tokens generated", tag_keys=("speculative",))
        self.active = metrics.Gauge(
            "jetflow_active_generations", description="generations in progress on this replica")

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.inc(tags={"endpoint": endpoint, "status": str(status)})
        self.latency.observe(seconds, tags={"endpoint": endpoint})

    def generation(self, speculative: bool, tau: float, tokens_per_s: float, tokens: int) -> None:
        tags = {"speculative": str(speculative).lower()}
        if tokens:
            self.tau.observe(tau, tags=tags)
            self.tokens_per_s.observe(tokens_per_s, tags=tags)
            self.generated.inc(tokens, tags=tags)
