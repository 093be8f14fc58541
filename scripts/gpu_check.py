"""One GPU check, under five minutes: what can be verified on a CUDA machine, each part run only
where its packages are importable (a lent GPU machine may have torch and Triton but no network).

1. The Triton kernels against their PyTorch references on CUDA (needs torch, triton).
2. The PyTorch backend on CUDA with CUDA graphs against ONNX Runtime's greedy tokens on a tiny
   engine (needs the project's dependencies: transformers, onnx, onnxruntime, ...).
3. Where TensorRT or TensorRT-RTX is importable: tiny fp16 engines with our plugins, built for this
   GPU and run, against ONNX Runtime's greedy tokens.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


def check_kernels() -> None:
    from plugins.block_attention.reference import block_attention as attention_reference
    from plugins.block_attention.triton_kernel import block_attention
    from plugins.d2t_gather.reference import d2t_gather as d2t_reference
    from plugins.d2t_gather.triton_kernel import d2t_gather

    g = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        for causal in (True, False):
            q = torch.randn(3, 8, 7, 64, generator=g)
            k_new, v_new = (torch.randn(3, 2, 7, 64, generator=g) for _ in range(2))
            caches = [torch.randn(3, 2, 512, 64, generator=g) for _ in range(2)]
            start = torch.tensor([0, 100, 505])
            expected, k_expected, _ = attention_reference(q, k_new, v_new, *caches, start, causal, 0.125)
            on = [t.cuda().to(dtype) for t in (q, k_new, v_new, *caches)]
            out = torch.empty_like(on[0])
            block_attention(*on, start.cuda(), out, causal=causal, scale=0.125)
            error = (out.float().cpu() - expected).abs().max().item()
            assert error < tolerance, f"block_attention {dtype} causal={causal}: error {error}"
            assert torch.equal(on[3].cpu(), k_expected.to(dtype)), "in-place K write"
    scores = torch.randn(4, 151936, generator=g)
    d2t, w1 = torch.zeros(151936, dtype=torch.long), torch.randn(151936, 256, generator=g)
    ids, rows = torch.empty(4, dtype=torch.long, device="cuda"), torch.empty(4, 256, device="cuda")
    d2t_gather(scores.cuda(), d2t.cuda(), w1.cuda(), ids, rows)
    expected_ids, expected_rows = d2t_reference(scores, d2t, w1)
    assert torch.equal(ids.cpu(), expected_ids) and torch.equal(rows.cpu(), expected_rows), "d2t_gather"
    print("kernels: block_attention (fp32/fp16/bf16, causal and not) and d2t_gather match the references")


def check_backends() -> None:
    from export.build import build
    from export.onnx_export import Limits
    from export.tiny import TinySpec, make_tiny
    from runtime.ort_backend import OrtBackend
    from runtime.speculative import generate
    from runtime.torch_backend import TorchBackend

    with tempfile.TemporaryDirectory() as tmp:
        target, draft = make_tiny(Path(tmp) / "pair", TinySpec())
        limits = Limits(max_batch=4, max_seq_len=128, max_prompt_chunk=8)
        build(str(target), str(draft), Path(tmp) / "fp32", limits=limits, progress=False)
        expected = generate(OrtBackend(Path(tmp) / "fp32"), PROMPTS, max_new_tokens=48).token_ids
        cuda = TorchBackend.from_engine(Path(tmp) / "fp32", device="cuda", cuda_graphs=True)
        for attempt in range(2):  # the second run replays the graphs captured by the first
            got = generate(cuda, PROMPTS, max_new_tokens=48).token_ids
            assert got == expected, f"torch-cuda with CUDA graphs differs from ORT (run {attempt})"
        print("backends: torch on CUDA with CUDA graphs == ONNX Runtime greedy tokens "
              "(captured and replayed)")
        for backend, module in (("trt", "tensorrt"), ("trt-rtx", "tensorrt_rtx")):
            if importlib.util.find_spec(module) is None:
                print(f"backends: {module} not importable; {backend} engines not checked")
                continue
            from runtime.trt_backend import TrtBackend

            out = Path(tmp) / backend
            major, minor = torch.cuda.get_device_capability()
            gpus = () if backend == "trt" else (f"sm{major}{minor}",)
            build(str(target), str(draft), out, limits=limits, dtype="fp16", backend=backend, gpus=gpus,
                  progress=False)
            reference = generate(OrtBackend(out), PROMPTS, max_new_tokens=48).token_ids
            got = generate(TrtBackend(out, backend=backend), PROMPTS, max_new_tokens=48).token_ids
            assert got == reference, f"{backend} engines differ from ONNX Runtime on the fp16 graphs"
            print(f"backends: {backend} engines with our plugins == ONNX Runtime greedy tokens (fp16)")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here")
    print(f"GPU: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}),"
          f" torch {torch.__version__}")
    started = time.perf_counter()
    check_kernels()
    if all(importlib.util.find_spec(m) for m in ("transformers", "onnx", "onnxruntime", "onnxscript")):
        check_backends()
    else:
        print("backends: the project's dependencies are not installed here; backend checks skipped")
    print(f"gpu_check passed in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
