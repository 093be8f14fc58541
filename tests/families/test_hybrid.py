"""The gate models: Qwen3.5 / Qwen3.6 hybrid targets (gated DeltaNet + gated attention), dense and
MoE, in both on-disk layouts, and Qwen3-MoE: greedy speculative == target-only == ``transformers``
``generate``, token for token, at batch 1 and ragged batch 3, prompts longer than a prefill chunk,
with oracle drafts so that every acceptance count 0..k restores the recurrent state from its slot;
and their bad checkpoints."""
import json
import shutil

import pytest
import torch

from export.onnx_export import BuildLimits
from modeling.checkpoint import CheckpointError
from modeling.pair import load_pair
from plugins.cpu.build import library
from runtime.backends.pytorch import TorchBackend

from oracles import (
    CHUNK,
    check_engine_invariant,
    check_speculative_equals_target_only,
    check_torch_invariant,
)

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

ARCHS = ["qwen3_5", "qwen3_5-multimodal", "qwen3_moe", "qwen3_5_moe-multimodal"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_target_only_and_transformers(tiny, arch):
    check_torch_invariant(*tiny(arch=arch))


def _copy(source, root):
    copy = root / source.name
    shutil.copytree(source, copy)
    return copy


def test_layer_types_that_disagree_with_the_weights_are_named(tiny, tmp_path):
    target_dir, draft_dir = tiny(arch="qwen3_5")
    target = _copy(target_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["layer_types"] = ["full_attention"] + config["layer_types"][1:]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: field 'layer_types'\[0\] = 'full_attention', "
                                              r"but the weights hold layers.0.linear_attn"):
        load_pair(target, draft_dir)


def test_linear_head_counts_that_disagree_with_the_weights_are_named(tiny, tmp_path):
    target_dir, draft_dir = tiny(arch="qwen3_5")
    target = _copy(target_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["linear_num_value_heads"] = 2
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="linear_attn.* has shape .* expected .* from config.json"):
        load_pair(target, draft_dir)


def _qwen3_moe_gguf(path, experts_type, width: int = 768) -> None:
    """A Qwen3-MoE GGUF file as llama.cpp's converter writes one (``qwen3moe``): a tiny random
    ``transformers`` model, its matrices and expert stacks (``blk.N.ffn_{gate,up,down}_exps``,
    ``[E, N, K]``) as ``experts_type`` and Q8_0 blocks, the router and norms float32, and the tiny
    pair's one-token-per-character vocabulary as a byte-level BPE. Experts ``width`` wide; 768 is
    the one ``transformers`` itself reads from such a file (it ignores
    ``expert_feed_forward_length``)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from modeling.fixtures.tiny import CHARACTERS, SPECIALS

    torch.manual_seed(0)
    tokens = SPECIALS + [c if 33 <= ord(c) <= 126 else chr(256 + ord(c)) for c in CHARACTERS]
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                  moe_intermediate_size=width, initializer_range=0.25,
                                  tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("mlp.gate.weight"):
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.5)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for add, value in (("block_count", 4), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("expert_feed_forward_length", width),
                       ("head_count", 4), ("head_count_kv", 2), ("key_length", 16), ("value_length", 16),
                       ("rope_freq_base", 1e4), ("layer_norm_rms_eps", 1e-6), ("expert_count", 8),
                       ("expert_used_count", 2)):
        getattr(writer, f"add_{add}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_scores([0.0] * len(tokens))   # no merges: none to derive
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    names = {"embed_tokens": "token_embd", "lm_head": "output", "norm": "output_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(name, array, kind=None):
        if kind is None:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), kind), raw_dtype=kind)

    for name, tensor in model.state_dict().items():
        array, name = tensor.numpy(), name.removeprefix("model.")
        if not name.startswith("layers."):   # embed_tokens, lm_head, norm
            module = name.rpartition(".")[0]
            add(f"{names[module]}.weight", array, q8 if module == "lm_head" else None)
            continue
        _, layer, rest = name.split(".", 2)
        module, _, suffix = rest.rpartition(".")
        if module == "mlp.experts":   # gate_up_proj [E, 2I, H] or down_proj [E, H, I]
            size = array.shape[1] // 2
            stacks = ({"gate": array[:, :size], "up": array[:, size:]} if suffix == "gate_up_proj"
                      else {"down": array})
            for kind, stack in stacks.items():
                add(f"blk.{layer}.ffn_{kind}_exps.weight", stack, experts_type)
        else:
            add(f"blk.{layer}.{names[module]}.{suffix}", array,
                q8 if array.ndim == 2 and module != "mlp.gate" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_moe_gguf_target_keeps_its_expert_blocks(tiny, tmp_path):
    """A Qwen3-MoE GGUF file (Q8_0 matrices and experts; Q4_0 experts in a second one): its module
    keeps the greedy invariant against ``transformers`` on the file; with ``--weights gguf`` each
    sparse layer's experts are one ``MoeExpertsInt8`` / ``Int4`` node holding the file's own
    blocks, the router float, and the engine's speculative output equals its target-only output.
    Q4_1 experts, which those nodes cannot hold, are refused from the header."""
    gguf = pytest.importorskip("gguf")
    import onnx

    from export.build import build

    draft_dir = tiny(arch="qwen3_moe")[1]
    limits = BuildLimits(max_batch=3, max_seq_len=96, max_prompt_chunk=CHUNK)
    for kind, op in ((gguf.GGMLQuantizationType.Q8_0, "MoeExpertsInt8"),
                     (gguf.GGMLQuantizationType.Q4_0, "MoeExpertsInt4")):
        path, engine = tmp_path / f"{kind.name}.gguf", tmp_path / kind.name
        _qwen3_moe_gguf(path, kind)
        result = build(str(path), str(draft_dir), engine, weights="gguf", progress=False, limits=limits)
        graph = onnx.load(engine / "target.onnx", load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert ops.count(op) == 4 and "MoeExperts" not in ops
        floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
        assert {f"layers.{i}.mlp.gate.weight" for i in range(4)} <= floats
        assert result.quantized_layers["target"] == 4 * (4 + 2) + 1   # q, k, v, o and the experts; lm_head
        if op == "MoeExpertsInt8":
            check_torch_invariant(path, draft_dir)
        check_speculative_equals_target_only(engine)
    path = tmp_path / "q4_1.gguf"
    _qwen3_moe_gguf(path, gguf.GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match=r"--weights gguf: .* holds 12 matrices of types it cannot keep "
                                         r"\(blk.0.ffn_gate_exps.weight \(Q4_1 experts\)"):
        build(str(path), str(draft_dir), tmp_path / "e", weights="gguf", progress=False, limits=limits)


def test_a_moe_gguf_files_expert_width_is_its_own(tmp_path):
    """``transformers`` 5.x ignores ``expert_feed_forward_length`` and would build 768-wide
    experts for any Qwen3-MoE file (then fail on its weights): the width is the file's, as
    llama.cpp reads it."""
    gguf = pytest.importorskip("gguf")
    from modeling.target import load_target

    path = tmp_path / "narrow.gguf"
    _qwen3_moe_gguf(path, gguf.GGMLQuantizationType.Q8_0, width=256)
    target = load_target(path)
    assert target.config.moe.expert_size == 256
    assert target.layers[0].mlp.experts.down_proj.shape == (8, 64, 256)


def test_a_multimodal_checkpoint_without_text_weights_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    target_dir, draft_dir = tiny(arch="qwen3_5-multimodal")
    target = _copy(target_dir, tmp_path)
    weights = target / "model.safetensors"
    save_file({n: t for n, t in load_file(weights).items() if "language_model" not in n}, weights)
    with pytest.raises(CheckpointError, match=r"no text weights \(model.language_model.\*\)"):
        load_pair(target, draft_dir)


def test_the_vision_tower_and_mtp_layer_are_never_read(tiny, tmp_path, monkeypatch):
    """Only the text model's tensors are read from the file (a 27B release's vision tower and MTP
    layer are GBs)."""
    from safetensors.torch import load_file, save_file

    import modeling.checkpoint

    target_dir, draft_dir = tiny(arch="qwen3_5-multimodal")
    target = _copy(target_dir, tmp_path)
    weights = target / "model.safetensors"
    save_file({**load_file(weights), "mtp.fc.weight": torch.zeros(2, 2)}, weights)
    read = []
    real = modeling.checkpoint.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(modeling.checkpoint, "safe_open", Recording)
    load_pair(target, draft_dir)
    assert read and not [n for n in read if n.startswith(("model.visual.", "mtp."))]


def test_onnx_runtime_engine_equals_transformers(tiny, engine_dir):
    """The exported graphs (the recurrence as its ONNX function, the selected experts on the compiled
    kernel where it is built, else their function; the banks bound in place, one sequence per
    call) give transformers' output, speculative with every
    acceptance count and target-only, at batch 1 and 3, over prefill chunks shorter than the
    prompts. One pair with every feature: Qwen3.5-MoE in the multimodal layout (Qwen3-MoE runs the
    same expert op beside the dense attention the other engine tests cover)."""
    arch = "qwen3_5_moe-multimodal"
    limits = BuildLimits(max_batch=3, max_seq_len=96, max_prompt_chunk=CHUNK)
    check_engine_invariant(engine_dir(limits, arch=arch), tiny(arch=arch)[0])


def test_tensorrt_rtx_engine_builds_on_the_cpu(tiny, tmp_path):
    """fp16 (the RMSNorm input cast restored), every linear layer's recurrence a GatedDeltaRule
    plugin and its conv window a CacheWrite, the kept states' profiles as the logit rows'."""
    pytest.importorskip("tensorrt_rtx")
    from export.build import build

    limits = BuildLimits(max_batch=2, max_seq_len=64, max_prompt_chunk=8)
    build(*map(str, tiny(arch="qwen3_5")), tmp_path, limits=limits,
          dtype="fp16", backend="trt-rtx", gpus=("sm89",), progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    linear = manifest["target"]["linear"]["layer_types"].count("linear_attention")
    full = len(manifest["target"]["linear"]["layer_types"]) - linear
    assert manifest["trt-rtx"]["plugin_layers"]["target"] == {
        "GatedDeltaRule": linear, "CacheWrite": linear, "BlockAttention": full}
    k = manifest["draft"]["k"]
    profiles = manifest["trt-rtx"]["profiles"]["target"]
    assert profiles["prefill"]["state_rows"] == [[1, 1], [2, 1], [2, k + 1]]
    assert profiles["decode"]["state_rows"] == [[1, 1], [2, k + 1], [2, k + 1]]
    state = next(t for t in manifest["graphs"]["target"]["inputs"] if t["name"] == "state_cache_0")
    assert state["dtype"] == "float32" and state["shape"][1] == k + 1


@pytest.mark.parametrize("weights, op", [("float", "MoeExperts"), ("int4", "MoeExpertsInt4")])
def test_moe_tensorrt_rtx_engine_builds_on_the_cpu(tiny, tmp_path, weights, op):
    """Each sparse layer's experts one plugin (layer 1 of the tiny Qwen3-MoE is dense), float or
    quantized. fp32: the tiny MoE pairs' fp16 logits stray 5-10% from fp32 in ``transformers``
    too, past the build's check."""
    pytest.importorskip("tensorrt_rtx")
    from export.build import build

    limits = BuildLimits(max_batch=2, max_seq_len=64, max_prompt_chunk=8)
    build(*map(str, tiny(arch="qwen3_moe")), tmp_path, limits=limits,
          backend="trt-rtx", gpus=("sm89",), weights=weights, progress=False)
    plugins = json.loads((tmp_path / "manifest.json").read_text())["trt-rtx"]["plugin_layers"]["target"]
    assert plugins == {"BlockAttention": 4, op: 3}


def test_int4_engine_speculative_equals_target_only(tiny, tmp_path):
    """Quantized linear layers (the DeltaNet's projections included) and experts (only the selected
    ones de-quantized, the router float): speculative output with every acceptance count equals
    target-only output on the same engine, batch 1 and 3."""
    import onnx

    from export.build import build

    target_dir, draft_dir = tiny(arch="qwen3_5_moe-multimodal")
    result = build(str(target_dir), str(draft_dir), tmp_path, progress=False, weights="int4",
                   limits=BuildLimits(max_batch=3, max_seq_len=96, max_prompt_chunk=CHUNK))
    graph = onnx.load(tmp_path / "target.onnx", load_external_data=False).graph
    layers = len(json.loads((tmp_path / "manifest.json").read_text())["target"]["linear"]["layer_types"])
    ops = [n.op_type for n in graph.node]
    assert ops.count("MoeExpertsInt4") == layers and "MoeExperts" not in ops
    floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    assert {f"layers.{i}.mlp.gate.weight" for i in range(layers)} <= floats
    # per layer: the experts' two stacks, the shared expert's three, two projections at least; lm_head
    assert result.quantized_layers["target"] >= layers * (2 + 3 + 2) + 1
    if library() is not None:   # the experts on the compiled kernel (plugins/moe/ort_cpu.py)
        import onnx_ir as ir

        from plugins.moe import ort_cpu
        model = ir.load(tmp_path / "target.onnx")
        assert len(ort_cpu.lower(model, "target.onnx.data")) == 6 * layers
    check_speculative_equals_target_only(tmp_path)


def test_more_states_than_the_bank_holds_are_named(tiny):
    target, draft = load_pair(*tiny(arch="qwen3_5"))
    backend = TorchBackend(target, draft, capacity=32)
    backend.start(1)
    slots = backend.limits.state_slots
    assert slots == draft.k + 1
    ids = torch.zeros(1, slots + 1, dtype=torch.long)
    rows = torch.arange(slots + 1)[None]
    with pytest.raises(ValueError, match=f"state_rows: {slots + 1} states to keep, the engine has "
                                         f"{slots} slots"):
        backend.target_step(ids, torch.tensor([0]), rows, torch.tensor([0]), rows)
