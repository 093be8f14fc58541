"""The ONNX Runtime backend: runs an engine directory's graphs on the CPU.

A sequence's tokens must not depend on which other sequences share its steps, nor on how many
rows a step gives it: greedy speculative output (``k + 1`` rows per verify step) equals target-only
output (one row per step) only if every row gets the logits it would get alone, bit for bit, and
on quantized weights a difference of 1e-6 grows to a changed token (int8 activations round it,
and 30 layers carry it: 0.8 in a logit of the demo's gguf engine). Measured on ORT 1.32, three
things in ONNX Runtime's CPU kernels make a row's result depend on its call:

- a call of exactly one row takes another kernel than a call of two or more (``MatMulNBits``
  at every accuracy level, plain fp32 ``MatMul``, and the attention's products per head): so a
  one-row step, or a step wanting one logit row, is made a two-row one, the row repeated and the
  copy's results dropped (the copy writes its K/V one row past the sequence's end, which the next
  step overwrites before any row reads it);
- the portable attention attends over the rows the batch's longest sequence sees, so a
  sequence's sums run over more masked columns when a longer one shares its step;
- the portable attention and ONNX Runtime's own ``GroupQueryAttention`` (what the target's
  attention is lowered to, ``plugins/block_attention/ort_contrib.py``) round differently, and
  ``GroupQueryAttention`` takes several new rows over a past only for one sequence.

Where the compiled CPU kernels are built for this machine (``plugins/cpu``: ``scripts/setup.sh``,
or on first use) and the target is a dense fp32 decoder, the target runs a whole batch in one
call: its weight products on ``QMatMul`` / ``FMatMul`` (each weight block read once for all the
rows of the call, each output row computed in a fixed order of its own) and its attention on
``CausalAttention`` over a pool of cache slots (each sequence over its own visible rows only).
A row's result is then the same alone, beside any rows, and in a one-row call, by construction,
with no padding (``tests/graphs/test_quantize.py``, ``tests/graphs/test_gguf.py``,
``tests/ops/test_cpu_kernels.py``).
An fp32 draft runs its batch in one call the same way, its context write and block attention on
``DraftAttention``.

Elsewhere (a hybrid, Gemma 4 or fp16 graph, a machine without the kernels)
a graph runs one sequence per call, lowered: each sequence has its own caches (its own
``IOBinding``), a step of ``B`` sequences is ``B`` calls into shared input and output buffers,
and a one-row call is made a two-row one as above. A sequence then computes exactly what it
computes alone there too, but the weights are read once per sequence rather than once per step.

The KV caches live in ONNX Runtime ``OrtValue``s allocated once per batch; each call binds the same
value as the cache input and the cache output, so ONNX Runtime updates them in place and nothing
copies them. The other outputs are written into buffers kept per shape: a returned tensor is valid
until the next call of the same step with the same shape.

Quantized engines (``build --weights``) without the compiled kernels run with ONNX Runtime's
fastest CPU path for them: each ``DequantizeLinear -> MatMul`` fused into ``MatMulNBits`` with
``accuracy_level`` 4 (activations quantized to int8 per block and row, as the kernel does).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from common.manifest import cache_output, is_cache, weight_formats
from plugins.block_attention.ort_contrib import target_rotary
from plugins.block_attention.ort_cpu import SLOTS
from plugins.cpu.build import library
from plugins.ort_session import lowered_session
from runtime.backends.base import Hints
from runtime.backends.engine import EngineBackend, damaged

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class OrtBackend(EngineBackend):
    # host_threads: the loop's torch work between calls is small (argmax / sampling over a few
    # rows); on more threads torch's idle OpenMP workers spin after it and take the cores from ONNX
    # Runtime. default_batch: where sequences run one per call a batch is no faster than its
    # prompts one after another (docs/usage.md, "Batching on the CPU"), and a batch of one ends
    # with its own prompt; a batched target (``batched``) takes the engine's whole batch
    hints = Hints(host_threads=1, default_batch=1)

    def __init__(self, engine: str | Path, threads: int | None = None, lower: bool = True,
                 kernel: bool = True):
        """``threads``: ONNX Runtime's intra-op threads (None: all cores); ``lower`` False runs the
        graphs as the engine holds them, ``kernel`` False on ONNX Runtime's own kernels rather than
        the compiled ones, one sequence per call (to compare the forms)."""
        if threads is not None and threads < 1:
            raise ValueError(f"threads {threads}: expected at least 1 (None: all cores)")
        super().__init__(engine)
        m = self.manifest
        if m["dtype"] not in NUMPY_DTYPES:
            raise ValueError(f"{self.directory}: dtype {m['dtype']} engines cannot run on the ONNX "
                             f"Runtime CPU backend; build with --dtype fp32 or fp16")
        self.threads = threads
        self.quantized = set(weight_formats(m).values()) != {"float"}
        self.kernel = library() if kernel and lower else None
        self._rotary = target_rotary(m["target"], m["limits"]["max_seq_len"])
        self.sessions, self.lowered = {}, {}   # graph -> its session, and whether it runs lowered
        for name in m["graphs"]:
            session = self._load(name, lowered=True) if lower else None
            self.lowered[name] = session is not None
            self.sessions[name] = session or self._load(name, lowered=False)
        # the graphs that run a whole batch in one call, on a pool of cache slots (plugins/cpu)
        self.pool_graphs = {name for name, session in self.sessions.items()
                       if SLOTS in {value.name for value in session.get_inputs()}}
        self.batched = "target" in self.pool_graphs
        self.pool_slots = None   # the slots of the pools ``start`` made
        if self.batched:
            self.hints = replace(self.hints, default_batch=None)

    def _options(self):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
        # workers spin between the ops of a call (waking them for each op costs more than the op on
        # a small CPU) but stop when it returns, so that they do not slow the loop's own work
        # between calls (verification, sampling) or the other graph's call
        options.add_session_config_entry("session.force_spinning_stop", "1")
        if self.quantized:   # ONNX Runtime's default too, pinned: see the module's docstring
            options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
        return options

    def _load(self, graph: str, lowered: bool):
        """A session of ``graph`` as the engine holds it, or lowered (None: nothing to lower).
        The lowered form (the target's attention as ``GroupQueryAttention``; the draft's block
        attention without copying its caches; measured in docs/measurements.md) holds for one
        sequence per call; with the compiled kernels a graph that allows it takes a batch in one
        call over a pool of slots."""
        import onnxruntime as ort

        path = self.file(self.manifest["graphs"][graph]["file"])
        try:
            if lowered:
                return lowered_session(path, self._options(), self._rotary, self.kernel,
                                       batched=True)
            return ort.InferenceSession(str(path), self._options(), providers=["CPUExecutionProvider"])
        except Exception as err:   # ONNX Runtime's and onnx_ir's errors share no base
            raise damaged(path, "ONNX Runtime cannot load it", err) from None

    def start(self, batch: int) -> None:
        """Caches for each of ``batch`` slots, bound in place: ``bindings[slot][graph]`` is that
        slot's, fresh and zeroed; a pooled graph's are one pool, ``pools[graph]`` its caches
        (``[slot]`` each slot's rows) and their binding. A pool of ``batch`` slots made before is
        kept as ``clear`` keeps a slot's rows (no sequence reads rows it did not write), with its
        bindings: zeroing it again cost each new ``Decoding`` 3-30 ms a slot (~100 MB of K/V)."""
        self.limits.check_batch(batch)
        self.bindings = [self._fresh_bindings() for _ in range(batch)]
        self._bound: dict[str, tuple] = {}
        if self.pool_slots != batch:
            self.pools = {name: self._bound_caches(name, batch) for name in self.pool_graphs}
            self.pool_slots = batch
            self._buffers: dict[tuple, tuple[dict, list]] = {}
            self._pool_bindings: dict[tuple, object] = {}   # a pooled graph's binding per shape

    def clear(self, slot: int) -> None:
        """A new sequence in ``slot`` (the others keep theirs): fresh zeroed caches for the graphs
        that run one sequence per call. A pooled graph's K/V rows are left as they are (zeroing
        them cost 12-17 ms a request on the demo target, 94 MB a slot): its attention reads only
        the rows its sequence has written (``plugins/block_attention/cpu_kernel.cpp``)."""
        self.bindings[slot] = self._fresh_bindings()
        self._bound.clear()

    def _fresh_bindings(self) -> dict:
        """One slot's ``IOBinding`` per graph that runs a sequence per call."""
        return {name: self._bound_caches(name, 1)[1] for name in self.sessions
                if name not in self.pool_graphs}

    def _bound_caches(self, graph: str, batch: int) -> tuple[list[np.ndarray], object]:
        """Zeroed caches of ``batch`` sequences for ``graph`` and an ``IOBinding`` holding each as
        both the cache input and the cache output (ONNX Runtime's ``OrtValue`` shares the array)."""
        caches = [np.zeros([batch if s == "batch" else s for s in cache["shape"]], dtype=self._numpy(cache))
                  for cache in self.manifest["graphs"][graph]["inputs"] if is_cache(cache["name"])]
        return caches, self._cache_binding(graph, caches)

    def _cache_binding(self, graph: str, caches: list[np.ndarray]):
        """A new ``IOBinding`` of ``graph`` with ``caches`` bound as its cache inputs and outputs."""
        import onnxruntime as ort

        binding = self.sessions[graph].io_binding()
        names = [t["name"] for t in self.manifest["graphs"][graph]["inputs"] if is_cache(t["name"])]
        for name, cache in zip(names, caches):
            value = ort.OrtValue.ortvalue_from_numpy(cache)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(cache_output(name), value)
        return binding

    def _run(self, graph: str, feeds: dict[str, torch.Tensor], outputs: tuple[str, ...],
             sizes: dict[str, int], slots: list[int] | None = None):
        """Copy ``feeds [B, ...]`` into this shape's input buffers, run each batch row ``b`` on
        the caches of slot ``slots[b]`` (default: slot ``b``) and its rows of the buffers, and
        return the output buffers as tensors. Buffers are made once per shape and bound again only
        when the shape or the slots change; a step that repeats the previous one (every decode
        step) only copies its small inputs."""
        slots = list(range(len(self.bindings))) if slots is None else list(slots)
        key = (graph, *sizes.values())
        if key not in self._buffers:
            self._buffers[key] = self._make_buffers(graph, feeds, outputs, sizes)
        inputs, results = self._buffers[key]
        if graph in self.pool_graphs:
            return self._run_batch(graph, inputs, outputs, results, key, slots, feeds)
        if self._bound.get(graph) != (key, slots):
            for row, slot in enumerate(slots):
                binding = self.bindings[slot][graph]
                for name, buffer in (*inputs.items(), *zip(outputs, results)):
                    bind = binding.bind_input if name in inputs else binding.bind_output
                    bind(name, "cpu", 0, buffer.dtype, [1, *buffer.shape[1:]],
                         buffer.ctypes.data + row * buffer.strides[0])
            self._bound[graph] = (key, slots)
        for name, tensor in feeds.items():
            np.copyto(inputs[name], tensor.numpy(), casting="same_kind")
        session = self.sessions[graph]
        for slot in slots:
            session.run_with_iobinding(self.bindings[slot][graph])
        return [torch.from_numpy(buffer) for buffer in results]

    def _run_batch(self, graph: str, inputs: dict, outputs: tuple[str, ...], results: list, key: tuple,
                   slots: list[int], feeds: dict[str, torch.Tensor]):
        """``_run`` of a pooled graph: one call for every sequence, ``slots`` an input. Each shape
        has a binding of its own, made once: the verify block's width and the draft's context
        rows change from step to step, and binding the buffers again cost ~0.1 ms a call."""
        binding = self._pool_bindings.get(key)
        if binding is None:
            binding = self._pool_bindings[key] = self._cache_binding(graph, self.pools[graph][0])
            for name, buffer in (*inputs.items(), *zip(outputs, results)):
                bind = binding.bind_input if name in inputs else binding.bind_output
                bind(name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        for name, tensor in feeds.items():
            np.copyto(inputs[name], tensor.numpy(), casting="same_kind")
        inputs[SLOTS][:] = slots
        self.sessions[graph].run_with_iobinding(binding)
        return [torch.from_numpy(buffer) for buffer in results]

    def _make_buffers(self, graph, feeds, outputs, sizes):
        specs = {t["name"]: t for t in (*self.manifest["graphs"][graph]["inputs"],
                                        *self.manifest["graphs"][graph]["outputs"])}

        def buffer(name):
            return np.empty([sizes.get(d, d) for d in specs[name]["shape"]], dtype=self._numpy(specs[name]))

        inputs = {name: buffer(name) for name in feeds}
        if graph in self.pool_graphs:
            inputs[SLOTS] = np.empty(sizes["batch"], np.int64)
        return inputs, [buffer(name) for name in outputs]

    @staticmethod
    def _numpy(tensor: dict):
        """The numpy dtype of a graph tensor (a hybrid's state caches are fp32 in any build)."""
        return {**NUMPY_DTYPES, "int64": np.int64}[tensor["dtype"]]

    def target_step(self, input_ids: torch.Tensor, start: torch.Tensor, logit_rows: torch.Tensor,
                    state_slot: torch.Tensor | None = None, state_rows: torch.Tensor | None = None,
                    slots: list[int] | None = None):
        rows, wanted = input_ids.shape[1], logit_rows.shape[1]
        if not self.batched and int(start.max()) + 1 < self.limits.capacity:
            # one-row calls take another kernel path (module docstring): made two-row calls; the
            # copy's recurrent state is never kept (state_rows names the real rows)
            input_ids = input_ids.repeat(1, 2) if rows == 1 else input_ids
            logit_rows = logit_rows.repeat(1, 2) if wanted == 1 else logit_rows
        feeds, sizes = self.limits.target_feeds(input_ids, start, logit_rows, state_slot, state_rows)
        logits, aux = self._run("target", feeds, ("logits", "aux"), sizes, slots)
        return logits[:, :wanted], aux[:, :rows]

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        feeds = dict(ctx_aux=ctx_aux, ctx_start=ctx_start, ctx_count=ctx_count, anchor=anchor,
                     temperature=temperature, noise=noise)
        return self._run("draft", feeds, ("tokens", "q"),
                         {"batch": anchor.shape[0], "ctx_rows": ctx_aux.shape[1]}, slots)
