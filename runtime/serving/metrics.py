"""What ``runtime.serve`` exposes at ``/metrics``: vLLM's figures under vLLM's names and meanings,
prefixed ``dspark:`` instead of ``vllm:``, in Prometheus text (``prometheus_client``)."""
from __future__ import annotations

from typing import Callable

# vLLM's buckets for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """One server's counters, gauges and histograms, in a registry of its own. Token counters
    move as steps run; the speculative counters and the per-request histograms when a request
    ends (a cancelled one too)."""

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()   # vLLM's exposition has no ``_created`` series either
        r = self.registry = CollectorRegistry()
        Gauge("dspark:num_requests_running", "Requests in a slot (prefilling or decoding).",
              registry=r).set_function(running)
        Gauge("dspark:num_requests_waiting", "Requests waiting for a slot.", registry=r).set_function(waiting)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter("dspark:generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter("dspark:request_success", "Ended requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.drafts = Counter("dspark:spec_decode_num_drafts", "Verify steps with drafts.", registry=r)
        self.draft_tokens = Counter("dspark:spec_decode_num_draft_tokens", "Drafts verified.", registry=r)
        self.accepted = Counter("dspark:spec_decode_num_accepted_tokens", "Drafts accepted.", registry=r)
        self.accepted_per_pos = Counter("dspark:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts accepted at each position of the block.", ["position"],
                                        registry=r)
        self.ttft = Histogram("dspark:time_to_first_token_seconds",
                              "From a request's arrival to its first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("dspark:time_per_output_token_seconds",
                              "A request's mean time per token after its first.", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("dspark:e2e_request_latency_seconds", "From a request's arrival to its end.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.step = Histogram("dspark:iteration_seconds", "One scheduler step (admit, decode, prefill).",
                              buckets=STEP_BUCKETS, registry=r)

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.ttft.observe(seconds)

    def ended(self, request, seconds: float, after_first: float | None) -> None:
        """``request`` (a ``scheduler.Request``) ended ``seconds`` after it arrived, ``after_first``
        after its first token (None: it had none)."""
        self.success.labels(request.finish_reason).inc()
        self.e2e.observe(seconds)
        if after_first is not None and len(request.token_ids) > 1:
            self.tpot.observe(after_first / (len(request.token_ids) - 1))
        stats = request.stats
        if stats.k:
            self.drafts.inc(stats.steps)
            self.draft_tokens.inc(stats.verified)
            self.accepted.inc(stats.accepted_tokens)
            for position, count in enumerate(stats.accepted_at):
                self.accepted_per_pos.labels(str(position)).inc(count)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
