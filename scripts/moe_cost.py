"""What a MoE layer's experts cost in ONNX Runtime (``dspark::MoeExperts``'s function body) at a
release's expert shapes, by tokens per step, beside the same op made to run every expert for every
token (what a dense compute of the experts would read): the selected experts only are read, so a
decode step reads ``k`` experts and a 9-row verify step at most ``9 k``. With ``--weights`` also
the int8 / int4 forms (``MoeExpertsInt8`` / ``Int4``, as ``build --weights`` writes them), which
de-quantize only the experts they read, and with ``--compiled`` every form on the compiled
kernels too (``plugins/moe/ort_cpu.py``), interleaved.

    python scripts/moe_cost.py [--experts 128 --top-k 8 --hidden 2048 --size 768] [--tokens 1 9 64]
                               [--weights float int8 int4] [--compiled]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--size", type=int, default=768, help="each expert's intermediate width")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 64])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", nargs="+", default=["float"], choices=["float", "int8", "int4"])
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--compiled", action="store_true",
                   help="also each form on the compiled kernels (plugins/cpu)")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    stacks = {"gate_up": torch.randn(args.experts, 2 * args.size, args.hidden, generator=g) * 0.02,
              "down": torch.randn(args.experts, args.hidden, args.size, generator=g) * 0.02}
    sessions = {form: _session(form, stacks, args) for form in args.weights}
    if args.compiled:
        sessions |= {f"{form}+": _session(form, stacks, args, compiled=True) for form in args.weights}
    feeds = {}
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=g)
        routed = torch.randn(tokens, args.experts, generator=g).softmax(-1).topk(args.top_k)
        every = torch.arange(args.experts).expand(tokens, -1)
        dense = (torch.full(every.shape, 1 / args.experts), every)
        for form, (weights, experts) in (("selected", routed), ("every expert", dense)):
            feeds[tokens, form] = ({"x": x.numpy(), "experts": experts.numpy(),
                                    "weights": weights.float().numpy()}, len(torch.unique(experts)))
    # every expert for every token: the float form only, the dense compute the selection avoids
    times = {(weights, key): [] for weights in sessions for key in feeds
             if weights == "float" or key[1] == "selected"}
    for round_ in range(args.rounds + 2):   # interleaved; the first two rounds warm up
        for (weights, key), samples in times.items():
            began = time.perf_counter()
            sessions[weights].run(None, feeds[key][0])
            if round_ >= 2:
                samples.append(time.perf_counter() - began)
    print(f"{args.experts} experts of {args.size} (top {args.top_k}), hidden {args.hidden}, fp32 "
          f"activations, {args.threads} threads, median (min-max) of {args.rounds} interleaved rounds"
          f"{'; +: on the compiled kernels' if args.compiled else ''}")
    for (weights, (tokens, form)), samples in times.items():
        touched = feeds[tokens, form][1]
        print(f"  {weights:5s} {tokens:4d} tokens, {form:12s}: {statistics.median(samples) * 1e3:8.1f} ms "
              f"({min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f}; {touched} experts read)")


def _session(weights: str, stacks: dict[str, torch.Tensor], args, compiled: bool = False):
    """An ONNX Runtime session of one ``MoeExperts`` node (or its int8 / int4 form) over
    ``stacks``; ``compiled``: lowered to the compiled kernels."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export import qdq, quantize
    from plugins.cpu.build import library
    from plugins.moe import onnx_function
    from plugins.onnx_domain import PLUGIN_ATTRIBUTES
    from plugins.ort_session import lowered_session

    if weights == "float":
        name, inputs = onnx_function.NAME, onnx_function.INPUTS
        function = onnx_function.MoeExperts.to_function_proto()
        constants = {m: t.numpy() for m, t in stacks.items()}
    else:
        bits = quantize.BITS[weights]
        name, inputs = f"{onnx_function.NAME}Int{bits}", onnx_function.QUANTIZED_INPUTS
        function, constants = onnx_function.quantized_function(bits), {}
        for m, t in stacks.items():
            q, scales, _ = qdq.expert_blocks(t.numpy(), quantize.rtn_blocks(bits, args.block))
            constants |= {f"{m}_q": q, f"{m}_scales": scales}
    value = helper.make_tensor_value_info
    node = helper.make_node(name, inputs, ["out"], domain="dspark", **PLUGIN_ATTRIBUTES)
    graph = helper.make_graph(
        [node], "moe", [value("x", TensorProto.FLOAT, [None, args.hidden]),
                        value("experts", TensorProto.INT64, [None, None]),
                        value("weights", TensorProto.FLOAT, [None, None])],
        [value("out", TensorProto.FLOAT, [None, args.hidden])],
        initializer=[numpy_helper.from_array(array, n) for n, array in constants.items()])
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("dspark", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    with tempfile.TemporaryDirectory() as folder:   # the experts are over protobuf's 2 GB
        path = Path(folder) / "moe.onnx"
        onnx.save_model(model, path, save_as_external_data=True)
        if compiled:
            return lowered_session(path, options, kernel=library())
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


if __name__ == "__main__":
    main()
