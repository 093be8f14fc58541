"""One GPU check, under five minutes: what can be verified on a CUDA machine, each part run only
where its packages are importable (a lent GPU machine may have torch and Triton but no network).

1. The Triton kernels against their PyTorch references on CUDA (needs torch, triton).
2. The PyTorch backend on CUDA with CUDA graphs against ONNX Runtime's greedy tokens on a tiny
   engine (needs the project's dependencies: transformers, onnx, onnxruntime, ...).
3. Each TensorRT plugin's ``enqueue`` (what TensorRT calls) on CUDA buffers without TensorRT, through
   a stand-in for the module's ``DataType`` names: in place and aliased as the engines bind the
   caches, with the attention's workspace sized as the plugin asks TensorRT for it.
4. Where TensorRT or TensorRT-RTX is importable and builds for this GPU (TensorRT-RTX does not
   target Hopper): tiny fp16 engines with our plugins, built for this GPU and run, against ONNX
   Runtime's greedy tokens.

Each step prints one verdict line (passed, skipped with the reason, or FAILED with the error); the
script runs every step and exits 1 if any failed.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


def limits():
    from export.onnx_export import BuildLimits

    return BuildLimits(max_batch=4, max_seq_len=128, max_prompt_chunk=8)


def check_kernels() -> str:
    from plugins.block_attention.reference import block_attention as attention_reference
    from plugins.block_attention.triton_kernel import block_attention
    from plugins.d2t_gather.reference import d2t_gather as d2t_reference
    from plugins.d2t_gather.triton_kernel import d2t_gather

    g = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        # causal, non-causal, and a sliding window over a ring of W + 6 rows that has wrapped
        for causal, window, capacity, start in ((True, 0, 512, [0, 100, 505]), (False, 0, 512, [0, 100, 505]),
                                                (True, 64, 70, [3, 300, 5000])):
            q = torch.randn(3, 8, 7, 64, generator=g)
            k_new, v_new = (torch.randn(3, 2, 7, 64, generator=g) for _ in range(2))
            caches = [torch.randn(3, 2, capacity, 64, generator=g) for _ in range(2)]
            start = torch.tensor(start)
            expected, k_expected, _ = attention_reference(q, k_new, v_new, *caches, start, causal, 0.125,
                                                          window)
            on = [t.cuda().to(dtype) for t in (q, k_new, v_new, *caches)]
            out = torch.empty_like(on[0])
            block_attention(*on, start.cuda(), out, causal=causal, scale=0.125, window=window)
            error = (out.float().cpu() - expected).abs().max().item()
            assert error < tolerance, f"block_attention {dtype} causal={causal} window={window}: {error}"
            assert torch.equal(on[3].cpu(), k_expected.to(dtype)), "in-place K write"
    scores = torch.randn(4, 151936, generator=g)
    d2t, w1 = torch.zeros(151936, dtype=torch.long), torch.randn(151936, 256, generator=g)
    ids, rows = torch.empty(4, dtype=torch.long, device="cuda"), torch.empty(4, 256, device="cuda")
    d2t_gather(scores.cuda(), d2t.cuda(), w1.cuda(), ids, rows)
    expected_ids, expected_rows = d2t_reference(scores, d2t, w1)
    assert torch.equal(ids.cpu(), expected_ids) and torch.equal(rows.cpu(), expected_rows), "d2t_gather"
    # the gated delta rule at Qwen3.6-27B's head shapes: a verify block keeping every row's state
    # in its slot, a prefill chunk keeping its last row's, each starting from a slot it overwrites
    from plugins.gated_delta.reference import gated_delta_rule as delta_reference
    from plugins.gated_delta.triton_kernel import gated_delta_rule

    for rows, picked in ((9, [list(range(9))]), (100, [[99]])):
        q, k = (torch.nn.functional.normalize(torch.randn(1, rows, 16, 128, generator=g), dim=-1)
                for _ in range(2))
        v, decay = torch.randn(1, rows, 48, 128, generator=g), -torch.rand(1, rows, 48, generator=g)
        beta, state = torch.rand(1, rows, 48, generator=g), torch.randn(1, 9, 48, 128, 128, generator=g)
        slot, picked = torch.tensor([0]), torch.tensor(picked)
        expected, expected_state = delta_reference(q, k, v, decay, beta, state, slot, picked)
        on = [t.cuda().contiguous() for t in (q, k, v, decay, beta, state, slot, picked)]
        out = torch.empty_like(on[2])
        gated_delta_rule(*on, out)
        error = max((out.cpu() - expected).abs().max().item(),
                    (on[5].cpu() - expected_state).abs().max().item())
        assert error < 1e-3, f"gated_delta_rule, {rows} rows: error {error}"
    # the routed experts at Qwen3.6-35B-A3B's shapes (256 of 512, top 8, hidden 2048), bf16: a
    # decode step, a verify block, a prefill chunk
    from plugins.moe.reference import moe_experts as moe_reference
    from plugins.moe.triton_kernel import moe_experts, workspace_bytes

    gate_up = (torch.randn(256, 1024, 2048, generator=g) * 0.02).bfloat16()
    down = (torch.randn(256, 2048, 512, generator=g) * 0.02).bfloat16()
    for tokens in (1, 9, 256):
        x = torch.randn(tokens, 2048, generator=g).bfloat16()
        weights, experts = torch.randn(tokens, 256, generator=g).softmax(-1).topk(8)
        expected = moe_reference(x.float(), experts, weights, gate_up.float(), down.float())
        out = torch.empty(tokens, 2048, dtype=torch.bfloat16, device="cuda")
        workspace = torch.empty(workspace_bytes(tokens, 8, 256, 2048, 512) // 4, device="cuda")
        moe_experts(x.cuda(), experts.cuda(), weights.bfloat16().cuda(), gate_up.cuda(), down.cuda(), out,
                    workspace)
        error = ((out.float().cpu() - expected).abs().max() / expected.abs().max()).item()
        assert error < 2e-2, f"moe_experts, {tokens} tokens: relative error {error}"
    return ("block_attention (fp32/fp16/bf16, causal and not, a sliding window's ring), d2t_gather, "
            "gated_delta_rule and "
            "moe_experts match the references")


def check_plugin_enqueue() -> str:
    from types import SimpleNamespace

    from export import qdq, quantize
    from plugins.block_attention.reference import block_attention as attention_reference
    from plugins.block_attention.trt_plugin import SPEC as ATTENTION
    from plugins.cache_write.reference import cache_write as write_reference
    from plugins.cache_write.trt_plugin import SPEC as CACHE_WRITE
    from plugins.d2t_gather.reference import d2t_gather as d2t_reference
    from plugins.d2t_gather.trt_plugin import SPEC as D2T
    from plugins.moe.reference import moe_experts as moe_reference
    from plugins.moe.trt_plugin import INT4_SPEC as MOE_INT4
    from plugins.moe.trt_plugin import SPEC as MOE

    kinds = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
             torch.int8: "i8"}
    trt = SimpleNamespace(DataType=SimpleNamespace(FLOAT="f32", HALF="f16", BF16="bf16", INT64="i64",
                                                   INT32="i32", INT8="i8", UINT8="u8"))

    def enqueue(spec, attrs, inputs, outputs):
        """As TensorRT would: raw pointers, descs, the workspace it reserved, its own stream."""
        descs = [[SimpleNamespace(type=kinds[t.dtype], dims=tuple(t.shape), max=tuple(t.shape)) for t in ts]
                 for ts in (inputs, outputs)]
        workspace = torch.empty((spec.workspace(descs[0]) if spec.workspace else 0) // 4 + 1, device="cuda")
        stream = torch.cuda.Stream()
        spec.enqueue(trt, attrs, *descs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                     workspace.data_ptr(), stream.cuda_stream)
        stream.synchronize()

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        cache = torch.randn(2, 8, 1024, 128, generator=g).to(dtype)
        context = torch.randn(2, 8, 9, 128, generator=g).to(dtype)
        ctx_start = torch.tensor([0, 900])
        k = cache.cuda()
        enqueue(CACHE_WRITE, {}, [k, context.cuda(), ctx_start.cuda()], [k])                 # aliased
        written = write_reference(cache, context, ctx_start)
        assert torch.equal(k.cpu(), written), f"CacheWrite {dtype} in place"
        copied = torch.zeros_like(k)
        enqueue(CACHE_WRITE, {}, [cache.cuda(), context.cuda(), ctx_start.cuda()], [copied])
        assert torch.equal(copied.cpu(), written), f"CacheWrite {dtype} into a distinct buffer"
        for causal, rows in ((True, 8), (False, 7)):
            q = torch.randn(2, 32, rows, 128, generator=g).to(dtype)
            k_new, v_new = (torch.randn(2, 8, rows, 128, generator=g).to(dtype) for _ in range(2))
            v = cache.flip(2).contiguous()
            keys, values = written.cuda(), v.cuda()
            start = ctx_start + 9
            out = torch.empty_like(q, device="cuda")
            enqueue(ATTENTION, {"causal": int(causal), "scale": 128 ** -0.5, "window": 0},
                    [q.cuda(), k_new.cuda(), v_new.cuda(), keys, values, start.cuda()], [out, keys, values])
            want, k_want, v_want = attention_reference(q.float(), k_new.float(), v_new.float(),
                                                       written.float(), v.float(), start, causal, 128 ** -0.5)
            error = (out.float().cpu() - want).abs().max().item()
            assert error < 3e-2, f"BlockAttention {dtype} causal={causal}: error {error}"
            assert torch.equal(keys.cpu().float(), k_want) and torch.equal(values.cpu().float(), v_want)
        scores = torch.randn(4, 151936, generator=g)
        d2t, w1 = torch.randint(0, 3, (151936,), generator=g), torch.randn(151939, 256, generator=g).to(dtype)
        ids = torch.empty(4, dtype=torch.long, device="cuda")
        picked = torch.empty(4, 256, dtype=dtype, device="cuda")
        enqueue(D2T, {}, [scores.cuda(), d2t.cuda(), w1.cuda()], [ids, picked])
        want_ids, want_rows = d2t_reference(scores, d2t, w1)
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(picked.cpu(), want_rows), f"D2TGather {dtype}"
        x = torch.randn(9, 256, generator=g).to(dtype)
        weights, experts = torch.randn(9, 16, generator=g).softmax(-1).topk(4)
        gate_up = (torch.randn(16, 128, 256, generator=g) * 0.05).to(dtype)
        down = (torch.randn(16, 256, 64, generator=g) * 0.05).to(dtype)
        out = torch.empty_like(x, device="cuda")
        enqueue(MOE, {}, [x.cuda(), experts.cuda(), weights.to(dtype).cuda(), gate_up.cuda(), down.cuda()],
                [out])
        want = moe_reference(x.float(), experts, weights, gate_up.float(), down.float())
        error = ((out.float().cpu() - want).abs().max() / want.abs().max()).item()
        assert error < 2e-2, f"MoeExperts {dtype}: relative error {error}"
        stacks = [quantize.dequantized(m, 4, 32).detach() for m in (gate_up, down)]
        blocks = [qdq.expert_blocks(m.float().numpy(), quantize.rtn_blocks(4, 32))[:2] for m in stacks]
        quantized = [t for q, scales in blocks
                     for t in (torch.from_numpy(q).cuda(), torch.from_numpy(scales).to(dtype).cuda())]
        enqueue(MOE_INT4, {}, [x.cuda(), experts.cuda(), weights.to(dtype).cuda(), *quantized], [out])
        want = moe_reference(x.float(), experts, weights, *(m.float() for m in stacks))
        error = ((out.float().cpu() - want).abs().max() / want.abs().max()).item()
        assert error < 2e-2, f"MoeExpertsInt4 {dtype}: relative error {error}"
    return ("CacheWrite, BlockAttention (workspace from the plugin), D2TGather and MoeExperts, "
            "float and int4 (their workspace), enqueue == references (fp16/bf16, caches aliased)")


class Skipped(Exception):
    """A step that cannot run on this machine; the message says why."""


def engine_gpus(backend: str, capability: tuple[int, int]) -> tuple[str, ...]:
    """What ``build --gpu`` gets for ``backend`` on a GPU of ``capability``, or ``Skipped`` where
    the backend is not installed or does not build for it."""
    from export.build_checks import GPUS
    from plugins.tensorrt_module import MODULES

    if importlib.util.find_spec(MODULES[backend]) is None:
        raise Skipped(f"{MODULES[backend]} is not importable")
    if backend == "trt":
        return ()   # TensorRT builds for the GPU it runs on
    gpu = "sm{}{}".format(*capability)
    if gpu not in GPUS:
        raise Skipped(f"TensorRT-RTX does not build for {gpu} (it targets {', '.join(GPUS)})")
    return (gpu,)


def tiny_pair(tmp: Path) -> tuple[Path, Path]:
    """The tiny random pair the engine steps share, made by the first that needs it."""
    from modeling.fixtures.tiny import TinySpec, make_tiny

    pair = tmp / "pair"
    if (pair / "draft" / "config.json").is_file():
        return pair / "target", pair / "draft"
    return make_tiny(pair, TinySpec())


def check_torch_backend(tmp: Path) -> str:
    from export.build import build
    from runtime.backends.ort import OrtBackend
    from runtime.backends.pytorch import TorchBackend
    from runtime.decoding.batch import generate

    engine = tmp / "fp32"
    build(*map(str, tiny_pair(tmp)), engine, limits=limits(), progress=False)
    expected = generate(OrtBackend(engine), PROMPTS, max_new_tokens=48).token_ids
    cuda = TorchBackend.from_engine(engine, device="cuda", cuda_graphs=True)
    for attempt in range(2):  # the second run replays the graphs captured by the first
        got = generate(cuda, PROMPTS, max_new_tokens=48).token_ids
        assert got == expected, f"torch-cuda with CUDA graphs differs from ORT (run {attempt})"
    return "torch on CUDA with CUDA graphs == ONNX Runtime greedy tokens (captured and replayed)"


def check_engines(backend: str, tmp: Path) -> str:
    from export.build import build
    from runtime.backends.ort import OrtBackend
    from runtime.backends.trt import TrtBackend
    from runtime.decoding.batch import generate

    gpus = engine_gpus(backend, torch.cuda.get_device_capability())
    out = tmp / backend
    build(*map(str, tiny_pair(tmp)), out, limits=limits(), dtype="fp16", backend=backend, gpus=gpus,
          progress=False)
    reference = generate(OrtBackend(out), PROMPTS, max_new_tokens=48).token_ids
    got = generate(TrtBackend(out, backend=backend), PROMPTS, max_new_tokens=48).token_ids
    assert got == reference, f"{backend} engines differ from ONNX Runtime on the fp16 graphs"
    return f"{backend} engines with our plugins == ONNX Runtime greedy tokens (fp16)"


def run_steps(steps: dict) -> bool:
    """Run each ``name -> callable`` step, print one verdict line each; whether none failed."""
    failed = False
    for name, step in steps.items():
        started = time.perf_counter()
        try:
            verdict = f"passed: {step()}"
        except Skipped as reason:
            verdict = f"skipped: {reason}"
        except Exception as err:  # noqa: BLE001 (every step runs and reports, whatever breaks)
            failed = True
            traceback.print_exc()
            verdict = f"FAILED: {type(err).__name__}: {' '.join(str(err).split())}"
        print(f"{name}: {verdict} ({time.perf_counter() - started:.0f}s)", flush=True)
    return not failed


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here")
    print(f"GPU: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}),"
          f" torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    project = all(importlib.util.find_spec(m) for m in ("transformers", "onnx", "onnxruntime", "onnxscript"))

    def needs_project(step):
        if not project:
            raise Skipped("the project's dependencies are not installed here")
        return step()

    with tempfile.TemporaryDirectory() as tmp:
        ok = run_steps({
            "kernels": check_kernels,
            "plugin enqueue": check_plugin_enqueue,
            "torch backend": lambda: needs_project(lambda: check_torch_backend(Path(tmp))),
            "trt engines": lambda: needs_project(lambda: check_engines("trt", Path(tmp))),
            "trt-rtx engines": lambda: needs_project(lambda: check_engines("trt-rtx", Path(tmp))),
        })
    print(f"gpu_check {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.0f}s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
