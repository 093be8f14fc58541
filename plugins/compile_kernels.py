"""``python -m plugins.compile_kernels --gpu sm89``: compile every Triton kernel ahead of time for
a GPU target, with representative fp16 / bf16 signatures. Needs no GPU (Triton ships ``ptxas``),
so it proves on any machine that the kernels compile. Run without ``TRITON_INTERPRET``."""
from __future__ import annotations

import argparse
import sys

KERNELS = {
    "block_attention._attend": (
        "plugins.block_attention.triton_kernel", "_attend",
        {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "out_ptr": "*fp16", "o_part_ptr": "*fp32",
         "lse_part_ptr": "*fp32", "start_ptr": "*i64", "heads": "i32", "kv_heads": "i32", "rows": "i32",
         "capacity": "i32", "scale": "fp32", "window": "i32"},
        {"CAUSAL": True, "GROUP": 4, "SPLITS": 8, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 32,
         "BLOCK_N": 64, "PRECISION": "tf32"}),
    "block_attention._merge": (
        "plugins.block_attention.triton_kernel", "_merge",
        {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "out_ptr": "*bf16", "heads": "i32",
         "kv_heads": "i32", "rows": "i32"},
        {"GROUP": 4, "SPLITS": 8, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 8}),
    "cache_write._write_rows": (
        "plugins.cache_write.triton_kernel", "_write_rows",
        {"new_ptr": "*bf16", "cache_ptr": "*bf16", "start_ptr": "*i64", "kv_heads": "i32",
         "rows": "i32", "capacity": "i32"},
        {"HEAD_DIM": 128, "BLOCK_D": 128}),
    "d2t_gather._block_argmax": (
        "plugins.d2t_gather.triton_kernel", "_block_argmax",
        {"scores_ptr": "*fp32", "ids_ptr": "*i64", "vocab": "i32"}, {"BLOCK_V": 4096}),
    "d2t_gather._finish": (
        "plugins.d2t_gather.triton_kernel", "_finish",
        {"ids_ptr": "*i64", "d2t_ptr": "*i64", "w1_ptr": "*fp16", "rows_ptr": "*fp16", "rank": "i32"},
        {"BLOCK_R": 256}),
    "gated_delta._recur": (
        "plugins.gated_delta.triton_kernel", "_recur",
        {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32",
         "state_ptr": "*fp32", "slot_ptr": "*i64", "rows_ptr": "*i64", "out_ptr": "*fp32",
         "rows": "i32", "heads": "i32", "key_heads": "i32", "slots": "i32", "captured": "i32"},
        {"KEY_DIM": 128, "VALUE_DIM": 128, "BLOCK_K": 128, "BLOCK_V": 32}),
    "moe._route": (
        "plugins.moe.triton_kernel", "_route",
        {"experts_ptr": "*i64", "counts_ptr": "*i32", "lists_ptr": "*i32", "pairs": "i32"}, {"BLOCK_P": 128}),
    "moe._gate_up": (
        "plugins.moe.triton_kernel", "_gate_up",
        {"x_ptr": "*bf16", "gate_up_ptr": "*i8", "gate_up_scales_ptr": "*bf16", "counts_ptr": "*i32",
         "lists_ptr": "*i32", "inter_ptr": "*fp32", "pairs": "i32", "hidden": "i32", "size": "i32"},
        {"TOP_K": 8, "BITS": 4, "QBLOCK": 32, "PRECISION": "tf32", "ACTIVATION": 0, "BLOCK_M": 16,
         "BLOCK_N": 64, "BLOCK_K": 64}),
    "moe._down": (
        "plugins.moe.triton_kernel", "_down",
        {"inter_ptr": "*fp32", "down_ptr": "*bf16", "down_scales_ptr": "*bf16", "weights_ptr": "*bf16",
         "counts_ptr": "*i32", "lists_ptr": "*i32", "rows_ptr": "*fp32", "pairs": "i32", "hidden": "i32",
         "size": "i32"},
        {"BITS": 0, "QBLOCK": 1, "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}),
    "moe._combine": (
        "plugins.moe.triton_kernel", "_combine",
        {"rows_ptr": "*fp32", "out_ptr": "*bf16", "hidden": "i32"}, {"TOP_K": 8, "BLOCK_H": 1024}),
}


def compile_all(capability: int) -> dict[str, int]:
    """Kernel name -> cubin size in bytes, compiled for ``sm_<capability>``."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sizes = {}
    for name, (module, attr, signature, constants) in KERNELS.items():
        kernel = getattr(importlib.import_module(module), attr)
        source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                           constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
        sizes[name] = len(compiled.asm["cubin"])
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m plugins.compile_kernels", description=__doc__)
    parser.add_argument("--gpu", default="sm89", help="compute capability, e.g. sm80, sm89, sm90 [sm89]")
    args = parser.parse_args(argv)
    if not args.gpu.lower().startswith("sm") or not args.gpu[2:].isdigit():
        raise SystemExit(f"error: --gpu {args.gpu}: expected smNN, e.g. sm89")
    for name, size in compile_all(int(args.gpu[2:])).items():
        print(f"{name:32} {args.gpu}: cubin {size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
