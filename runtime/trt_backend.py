"""The TensorRT / TensorRT-RTX backend: an engine directory's engines on a CUDA GPU.

Device buffers are torch CUDA tensors; each cache is one buffer bound as both the cache input and
its output, so the plugin writes in place. Every (graph, profile, sizes of the dynamic axes) is run
twice to warm up, captured once as a CUDA graph and replayed from then on (``cuda_graphs.py``). Outputs
stay on the device; the loop's verification runs there too, so a step's only host copy is the
accepted tokens.
"""
from __future__ import annotations

from pathlib import Path

import torch

from export import manifest as manifest_file
from export.manifest import cache_output, is_cache
from export.trt_build import import_tensorrt
from plugins.tensorrt_plugin import register_plugins

from .cuda_graphs import GraphCache
from .engine_backend import EngineBackend

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64}


class TrtBackend(EngineBackend):
    def __init__(self, engine: str | Path, backend: str = "trt-rtx", gpu: str | None = None):
        super().__init__(engine)
        m = self.manifest
        if backend not in m["backends"]:
            raise manifest_file.ManifestError(
                f"{self.directory}: no {backend} engines (built: {', '.join(m['backends'])}); rebuild "
                f"with `python -m export build ... --dtype fp16 --backend {backend}`")
        if not torch.cuda.is_available():
            raise ValueError(f"--backend {backend} needs a CUDA GPU; use --backend ort on the CPU")
        trt = import_tensorrt(backend)
        self._creators = register_plugins(trt)  # keep alive while the engines exist
        major, minor = torch.cuda.get_device_capability()
        gpu = gpu or (f"sm{major}{minor}" if backend == "trt-rtx" else "local")
        files = m[backend]["engines"].get(gpu)
        if files is None:
            raise manifest_file.ManifestError(
                f"{self.directory}: no {backend} engines for {gpu} (built for "
                f"{', '.join(m[backend]['engines'])}); rebuild with --gpu {gpu}")
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engines = {graph: runtime.deserialize_cuda_engine(self.file(file).read_bytes())
                        for graph, file in files.items()}
        profiles = list(m[backend]["profiles"]["target"])
        self.contexts = {}
        for graph, engine_ in self.engines.items():
            for index, profile in enumerate(profiles):
                context = engine_.create_execution_context()
                context.set_optimization_profile_async(index, torch.cuda.current_stream().cuda_stream)
                self.contexts[graph, profile] = context
        self.device = torch.device("cuda")
        self.graphs = {graph: GraphCache(lambda *t, g=graph: self._execute(g, *t)) for graph in files}
        self._outputs: dict[tuple, list[torch.Tensor]] = {}
        self._key: tuple = ()

    def start(self, batch: int) -> None:
        self.check_batch(batch)
        self.caches = {}
        for graph in self.engines:
            specs = [t for t in self.manifest["graphs"][graph]["inputs"] if is_cache(t["name"])]
            self.caches[graph] = {t["name"]: torch.zeros([batch if d == "batch" else d for d in t["shape"]],
                                                         dtype=TORCH_DTYPES[t["dtype"]], device=self.device)
                                  for t in specs}
        for graphs in self.graphs.values():  # they captured the old caches' addresses
            graphs.clear()
        self._outputs.clear()

    def target_step(self, input_ids, start, logit_rows):
        batch, rows = input_ids.shape
        return self._run("target", [input_ids, start, logit_rows],
                         {"batch": batch, "rows": rows, "logit_rows": logit_rows.shape[1]})

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise):
        batch, rows = ctx_aux.shape[:2]
        return self._run("draft", [ctx_aux, ctx_start, ctx_count, anchor, temperature, noise],
                         {"batch": batch, "ctx_rows": rows})

    def _run(self, graph: str, inputs: list[torch.Tensor], sizes: dict[str, int]):
        """``sizes``: the step's dynamic axes; the rows (``rows`` or ``ctx_rows``) pick the profile."""
        rows = sizes.get("rows", sizes.get("ctx_rows"))
        profile = "decode" if rows <= self.k + 1 else "prefill"
        self._key = (graph, profile, *sizes.items())
        return self.graphs[graph](self._key[1:], [t.to(self.device) for t in inputs])

    def _execute(self, graph: str, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Bind and enqueue one step (called for warm-up and inside the graph capture)."""
        _, profile, *sizes = self._key
        sizes = dict(sizes)
        context = self.contexts[graph, profile]
        spec = self.manifest["graphs"][graph]
        plain = [t for t in spec["inputs"] if not is_cache(t["name"])]
        for tensor_spec, value in zip(plain, inputs):
            context.set_input_shape(tensor_spec["name"], tuple(value.shape))
            context.set_tensor_address(tensor_spec["name"], value.data_ptr())
        for name, cache in self.caches[graph].items():
            context.set_input_shape(name, tuple(cache.shape))
            context.set_tensor_address(name, cache.data_ptr())
            context.set_tensor_address(cache_output(name), cache.data_ptr())
        returned = [t for t in spec["outputs"] if not is_cache(t["name"])]
        if self._key not in self._outputs:
            self._outputs[self._key] = [
                torch.empty([sizes.get(d, d) for d in t["shape"]], dtype=TORCH_DTYPES[t["dtype"]],
                            device=self.device)
                for t in returned]
        outputs = self._outputs[self._key]
        for tensor_spec, buffer in zip(returned, outputs):
            context.set_tensor_address(tensor_spec["name"], buffer.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError(f"{graph}: TensorRT execution failed")
        return outputs
