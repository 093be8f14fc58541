"""The TensorRT / TensorRT-RTX backend: an engine directory's engines on a CUDA GPU.

Device buffers are torch CUDA tensors; each cache is one buffer bound as both the cache input and
its output, so the plugin writes in place. The decode steps are captured as CUDA graphs and
replayed, prefill runs eagerly (``cuda_graphs.py``). A captured key has an execution context of its
own, its shapes and addresses set once before warm-up: a graph replays the kernels and addresses it
was captured with, which reshaping a shared context would change. Every context uses one
activation buffer of ours (they run one at a time, on the backend's stream). Outputs stay on the
device; the loop's verification runs there too, so a step's only host copy is the accepted tokens.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common import manifest as manifest_file
from common.manifest import cache_output, is_cache
from plugins.tensorrt_module import import_tensorrt
from plugins.tensorrt_plugin import register_plugins
from runtime.backends.base import slot_block
from runtime.backends.cuda_graphs import Caches, GraphCache, Sizes
from runtime.backends.engine import EngineBackend

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64}


def create_context(trt, engine, profile: int, stream: int, memory: torch.Tensor, captured: bool):
    """An execution context on optimization profile ``profile`` (selected on ``stream``) that runs
    in ``memory``, our activation buffer.

    TensorRT-RTX compiles shape-specialized kernels at run time. Its default (lazy) runs a fallback
    kernel until the specialized one is compiled and then swaps it in, which would invalidate a
    graph captured before the swap; a ``captured`` context compiles them when a shape first runs
    (eager), which the warm-up does. Prefill contexts keep the lazy default: a new prompt length
    does not wait for a compilation. Its own whole-graph capture stays off: we capture whole steps."""
    user_managed = trt.ExecutionContextAllocationStrategy.USER_MANAGED
    if hasattr(trt, "DynamicShapesKernelSpecializationStrategy"):   # TensorRT-RTX
        config = engine.create_runtime_config()
        config.set_execution_context_allocation_strategy(user_managed)
        config.cuda_graph_strategy = trt.CudaGraphStrategy.DISABLED
        if captured:
            config.dynamic_shapes_kernel_specialization_strategy = (
                trt.DynamicShapesKernelSpecializationStrategy.EAGER)
        context = engine.create_execution_context(config)
    else:
        context = engine.create_execution_context(user_managed)
    if context is None:
        raise RuntimeError(f"{engine.name}: TensorRT could not create an execution context")
    context.set_device_memory(memory.data_ptr(), memory.numel())
    if not context.set_optimization_profile_async(profile, stream):
        raise RuntimeError(f"{engine.name}: TensorRT could not select optimization profile {profile}")
    return context


def stream_capturable(context, stream: int) -> bool:
    """What TensorRT-RTX says of capturing this context on ``stream``; full TensorRT cannot say."""
    return context.is_stream_capturable(stream) if hasattr(context, "is_stream_capturable") else True


class TrtBackend(EngineBackend):
    pooled = True    # decode steps replay CUDA graphs captured on the whole pool's caches

    def __init__(self, engine: str | Path, backend: str = "trt-rtx", gpu: str | None = None):
        super().__init__(engine)
        m = self.manifest
        if backend not in m["backends"]:
            raise manifest_file.ManifestError(
                f"{self.directory}: no {backend} engines (built: {', '.join(m['backends'])}); rebuild "
                f"with `python -m export build ... --dtype fp16 --backend {backend}`")
        if not torch.cuda.is_available():
            raise ValueError(f"--backend {backend} needs a CUDA GPU; use --backend ort on the CPU")
        self.trt = import_tensorrt(backend)
        self._creators = register_plugins(self.trt)  # keep alive while the engines exist
        major, minor = torch.cuda.get_device_capability()
        gpu = gpu or (f"sm{major}{minor}" if backend == "trt-rtx" else "local")
        files = m[backend]["engines"].get(gpu)
        if files is None:
            raise manifest_file.ManifestError(
                f"{self.directory}: no {backend} engines for {gpu} (built for "
                f"{', '.join(m[backend]['engines'])}); rebuild with --gpu {gpu}")
        runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        self.engines = {graph: runtime.deserialize_cuda_engine(self.file(file).read_bytes())
                        for graph, file in files.items()}
        self.device = torch.device("cuda")
        # not the legacy default stream, around which TensorRT synchronises the device
        self.stream = torch.cuda.Stream()
        self.memory = torch.empty(max(e.device_memory_size_v2 for e in self.engines.values()),
                                  dtype=torch.uint8, device=self.device)
        self.profiles = {name: index for index, name in enumerate(m[backend]["profiles"]["target"])}
        self.specs = {}
        for graph in self.engines:
            spec = m["graphs"][graph]
            self.specs[graph] = {"inputs": [t for t in spec["inputs"] if not is_cache(t["name"])],
                                 "caches": [t for t in spec["inputs"] if is_cache(t["name"])],
                                 "outputs": [t for t in spec["outputs"] if not is_cache(t["name"])]}
        self.eager_contexts = {(graph, profile): self._context(graph, profile, captured=False)
                               for graph in self.engines for profile in self.profiles}
        self.caches = Caches(self._allocate_caches)
        self.graphs = GraphCache(self.limits.k, self._eager, self._bind, stream=self.stream)

    def start(self, batch: int) -> None:
        self.limits.check_batch(batch)
        if self.caches.start(batch):   # graphs captured the old caches' addresses
            self.graphs.clear()

    def clear(self, slot: int) -> None:
        for tensors in self.caches.full.values():
            for tensor in tensors:
                tensor[slot].zero_()

    def target_step(self, input_ids, start, logit_rows, state_slot=None, state_rows=None, slots=None):
        feeds, sizes = self.limits.target_feeds(input_ids, start, logit_rows, state_slot, state_rows)
        return self._run("target", list(feeds.values()), sizes, slots)

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        batch, rows = ctx_aux.shape[:2]
        return self._run("draft", [ctx_aux, ctx_start, ctx_count, anchor, temperature, noise],
                         {"batch": batch, "ctx_rows": rows}, slots)

    def _run(self, graph: str, inputs: list[torch.Tensor], sizes: Sizes,
             slots: list[int] | None) -> list[torch.Tensor]:
        """One step on the backend's stream, ordered after the caller's work and before its next:
        the whole pool through the CUDA graphs, a block of its slots eagerly. Memory the caller
        freed is reused here only after this wait, so after its last reads."""
        block = slot_block(slots, self.caches.batch, "trt")
        inputs = [t.to(self.device).contiguous() for t in inputs]   # bound by address
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            if block == slice(0, self.caches.batch):
                outputs = self.graphs(graph, sizes, inputs)
            else:
                outputs = self._eager(graph, sizes, inputs, block)
        caller.wait_stream(self.stream)
        return outputs

    def _allocate_caches(self, batch: int) -> dict[str, list[torch.Tensor]]:
        return {graph: [torch.zeros([batch if d == "batch" else d for d in t["shape"]],
                                    dtype=TORCH_DTYPES[t["dtype"]], device=self.device)
                        for t in spec["caches"]]
                for graph, spec in self.specs.items()}

    def _context(self, graph: str, profile: str, captured: bool):
        return create_context(self.trt, self.engines[graph], self.profiles[profile],
                              self.stream.cuda_stream, self.memory, captured)

    def _profile(self, sizes: Sizes) -> str:
        rows = sizes["rows"] if "rows" in sizes else sizes["ctx_rows"]
        return "decode" if rows <= self.limits.k + 1 else "prefill"

    def _eager(self, graph: str, sizes: Sizes, inputs: list[torch.Tensor],
               block: slice = slice(None)) -> list[torch.Tensor]:
        """Prefill and any step that cannot be captured, on the ``block`` of slots: the profile's
        shared context, reshaped."""
        context = self.eager_contexts[graph, self._profile(sizes)]
        outputs = self._bind_tensors(context, graph, sizes, inputs, block)
        self._execute(context, graph)
        return outputs

    def _bind(self, graph: str, sizes: Sizes, inputs: list[torch.Tensor]):
        """A captured key's own context, bound to its static inputs and outputs before warm-up;
        ``None`` when TensorRT says it cannot be captured on the backend's stream."""
        context = self._context(graph, self._profile(sizes), captured=True)
        outputs = self._bind_tensors(context, graph, sizes, inputs)
        if not stream_capturable(context, self.stream.cuda_stream):
            return None

        def run() -> list[torch.Tensor]:
            self._execute(context, graph)
            return outputs

        return run

    def _bind_tensors(self, context, graph: str, sizes: Sizes, inputs: list[torch.Tensor],
                      block: slice = slice(None)):
        """Set the context's input shapes and every tensor's address (the caches of the ``block``
        of slots: a view of consecutive ones is contiguous); returns new output buffers."""
        spec = self.specs[graph]
        caches = [cache[block] for cache in self.caches[graph]]
        bound = [*zip(spec["inputs"], inputs), *zip(spec["caches"], caches)]
        for tensor_spec, value in bound:
            if not context.set_input_shape(tensor_spec["name"], tuple(value.shape)):
                raise RuntimeError(f"{graph}: TensorRT refused shape {tuple(value.shape)} for "
                                   f"{tensor_spec['name']}")
            context.set_tensor_address(tensor_spec["name"], value.data_ptr())
        for tensor_spec, cache in zip(spec["caches"], caches):
            context.set_tensor_address(cache_output(tensor_spec["name"]), cache.data_ptr())
        outputs = [torch.empty([sizes.get(d, d) for d in t["shape"]], dtype=TORCH_DTYPES[t["dtype"]],
                               device=self.device)
                   for t in spec["outputs"]]
        for tensor_spec, buffer in zip(spec["outputs"], outputs):
            context.set_tensor_address(tensor_spec["name"], buffer.data_ptr())
        return outputs

    def _execute(self, context, graph: str) -> None:
        """Enqueue on the backend's stream, which is also the one graphs are captured on."""
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{graph}: TensorRT execution failed")
