"""The benchmarks that measure the runtime, beside the scripts that run them (``scripts/``):
``python -m bench`` (``decoding.py``) times speculative against target-only decoding on one
engine, with ``transformers`` and llama.cpp (``llama_cpp_baseline.py``) as outside baselines."""
