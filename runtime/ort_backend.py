"""The ONNX Runtime backend: runs an engine directory's graphs on the CPU.

The KV caches live in ONNX Runtime ``OrtValue``s allocated once per batch; each step binds the same
value as the cache input and the cache output (IOBinding), so the loop never copies them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export import manifest as manifest_file

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class OrtBackend:
    def __init__(self, engine: str | Path, threads: int | None = None):
        import onnxruntime as ort

        self.directory = Path(engine)
        self.manifest = manifest_file.read(self.directory)
        m = self.manifest
        if m["dtype"] not in NUMPY_DTYPES:
            raise ValueError(f"{self.directory}: dtype {m['dtype']} engines cannot run on the ONNX "
                             f"Runtime CPU backend; build with --dtype fp32 or fp16")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        self.sessions = {name: ort.InferenceSession(str(self.directory / graph["file"]), options,
                                                    providers=["CPUExecutionProvider"])
                         for name, graph in m["graphs"].items()}
        self.vocab_size = m["target"]["vocab_size"]
        self.k = m["draft"]["k"]
        self.draft_vocab_size = m["draft"]["draft_vocab_size"]
        self.lookahead = max(self.k + 1, m["draft"]["block_size"])
        self.capacity = m["limits"]["max_seq_len"]
        self.max_batch = m["limits"]["max_batch"]
        self.max_prompt_chunk = m["limits"]["max_prompt_chunk"]
        self.eos_token_ids = tuple(m["target"]["eos_token_ids"])
        self._dtype = NUMPY_DTYPES[m["dtype"]]

    def start(self, batch: int) -> None:
        """Fresh zeroed caches for ``batch`` sequences, bound in place to both graphs."""
        import onnxruntime as ort

        if batch > self.max_batch:
            raise ValueError(f"batch of {batch} sequences: the engine was built for at most "
                             f"{self.max_batch} (--max-batch)")
        self.bindings, self._cache_count = {}, {}
        for name, session in self.sessions.items():
            caches = [t for t in self.manifest["graphs"][name]["inputs"] if "_cache_" in t["name"]]
            binding = session.io_binding()
            for cache in caches:
                shape = [batch if s == "batch" else s for s in cache["shape"]]
                value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=self._dtype))
                binding.bind_ortvalue_input(cache["name"], value)
                binding.bind_ortvalue_output(cache["name"].replace("_cache_", "_cache_out_"), value)
            self.bindings[name], self._cache_count[name] = binding, len(caches)

    def _run(self, graph: str, feeds: dict[str, torch.Tensor], outputs: tuple[str, ...]):
        binding = self.bindings[graph]
        for name, tensor in feeds.items():
            array = tensor.numpy()
            if array.dtype.kind == "f":
                array = array.astype(self._dtype if name == "ctx_aux" else np.float32, copy=False)
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in outputs:
            binding.bind_output(name, "cpu")
        self.sessions[graph].run_with_iobinding(binding)
        # bound outputs come back in binding order: the caches (bound in start()), then these
        return [torch.from_numpy(v.numpy()) for v in binding.get_outputs()[self._cache_count[graph]:]]

    def target_step(self, input_ids: torch.Tensor, start: torch.Tensor):
        return self._run("target", {"input_ids": input_ids, "start": start}, ("logits", "aux"))

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise):
        feeds = dict(ctx_aux=ctx_aux, ctx_start=ctx_start, ctx_count=ctx_count, anchor=anchor,
                     temperature=temperature, noise=noise)
        return self._run("draft", feeds, ("tokens", "q"))
