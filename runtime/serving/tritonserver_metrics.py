"""``runtime.serve``'s counters and gauges (``metrics.py``: tokens, requests by finish reason,
drafts proposed and accepted, per position) in Triton's own ``/metrics``, as the Python backend's
custom metrics under the same names, labelled with Triton's ``model`` and ``version`` and the
model instance. Triton measures latency itself (``nv_inference_*``), so our histograms stay out.
"""
from __future__ import annotations

import threading


class TritonMetrics:
    """Copies ``registry``'s counters and gauges into Triton every ``interval`` seconds, on a
    thread of its own, and once more at ``close``."""

    def __init__(self, pb_utils, registry, labels: dict[str, str], interval: float = 1.0):
        self.pb, self.registry, self.labels, self.interval = pb_utils, registry, labels, interval
        self.families: dict[str, object] = {}
        self.metrics: dict[tuple, tuple[object, float]] = {}   # (name, labels) -> metric, value copied
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="triton-metrics", daemon=True)
        self.thread.start()

    def copy(self) -> None:
        pb = self.pb
        for family in self.registry.collect():
            if family.type not in ("counter", "gauge"):
                continue
            kind = pb.MetricFamily.COUNTER if family.type == "counter" else pb.MetricFamily.GAUGE
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in self.metrics:
                    if sample.name not in self.families:
                        self.families[sample.name] = pb.MetricFamily(sample.name, family.documentation, kind)
                    metric = self.families[sample.name].Metric(labels={**self.labels, **sample.labels})
                    self.metrics[key] = metric, 0.0
                metric, copied = self.metrics[key]
                if family.type == "counter":
                    metric.increment(sample.value - copied)
                else:
                    metric.set(sample.value)
                self.metrics[key] = metric, sample.value

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.copy()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.copy()
