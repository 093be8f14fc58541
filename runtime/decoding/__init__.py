"""The propose / verify loop over a backend: continuous batching over cache slots (``scheduler``),
a batch started together (``batch``), the ``Generator`` API, and the parts of one step
(prefill, verification, sampling, penalties, stop strings, statistics)."""
