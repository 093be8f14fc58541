"""``python -m bench`` on a tiny engine: the report, its invariant checks, and the plot;
prompts a draft was distilled on refused."""
import json
import statistics
from pathlib import Path

import pytest

from bench import decoding as bench

from conftest import CLI_LIMITS

ROOT = Path(__file__).resolve().parents[2]


def test_bench_reports_and_plots(engine_dir, tmp_path, capsys):
    engine = engine_dir(CLI_LIMITS, arch="llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in ("the cat", "two plus two", "hi")))
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    bench.main(["--engine", str(engine), "--prompts-file", str(prompts), "--limit", "2",
                "--max-new-tokens", "16", "--prompt-lookup", "3", "--repeat", "2", "--out", str(out),
                "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and report["repeat"] == 2
    # the engine's modes: a figure per pass, their median reported, ratios with their spread
    for name in ("speculative", "target_only"):
        per_pass = report["runs"][name]["tokens_per_second_per_pass"]
        assert len(per_pass) == 2 and report["runs"][name]["tokens_per_second"] == sum(per_pass) / 2
    for name, ratio in report["ratios"].items():
        low, high = report["ratio_spread"][name]
        assert low <= ratio <= high
    runs = report["runs"]
    assert set(runs) == {"speculative", "target_only", "transformers", "transformers_prompt_lookup"}
    assert all(r["tokens"] > 0 and r["tokens_per_second"] > 0 for r in runs.values())
    assert len(runs["speculative"]["acceptance_per_position"]) == 4 and runs["target_only"]["tau"] == 1.0
    assert 0 < runs["speculative"]["host_fraction"] < 1
    # greedy: every method produced the same tokens as speculative decoding
    assert report["greedy_outputs_identical"] and all(report["greedy_outputs_identical"].values())
    # the ratio is the median over passes of the two modes' tokens/s in the same pass
    speculative, target_only = (runs[m]["tokens_per_second_per_pass"] for m in ("speculative", "target_only"))
    per_pass = sorted(s / t for s, t in zip(speculative, target_only))
    assert report["ratios"]["speculative/target_only"] == pytest.approx(statistics.median(per_pass))
    assert report["ratio_spread"]["speculative/target_only"] == pytest.approx([per_pass[0], per_pass[-1]])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each printed figure says what it is: the decode phase's speedup and the bound apart from the
    # end-to-end ratio (they read as two figures for one claim)
    printed = capsys.readouterr().out
    ratio = report["ratios"]["speculative/target_only"]
    assert f"end to end (prefill included), median of passes: speculative/target_only {ratio:.2f}x" in printed
    assert "decode phase alone (prefill left out, passes pooled): speculative / target-only " in printed


def _prompts(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in ("the cat", "two plus two", "hi")))
    return prompts


def test_a_llama_cpp_baseline_that_cannot_run_is_refused_first(engine_dir, tmp_path, capsys, monkeypatch):
    """Before any benchmark work, one line: a GGUF file missing, a draft without its target, or
    llama.cpp's tools not built for this CPU (an empty cache folder here)."""

    engine = engine_dir(CLI_LIMITS, arch="llama")
    args = ["--engine", str(engine), "--prompts-file", str(_prompts(tmp_path)), "--out",
            str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    present = tmp_path / "present.gguf"
    present.write_bytes(b"GGUF")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for flags, expected in (
            (["--llama-cpp", str(tmp_path / "nowhere.gguf")],
             f"error: --llama-cpp {tmp_path / 'nowhere.gguf'}: no such GGUF file"),
            (["--llama-cpp", str(present), "--llama-cpp-draft", str(tmp_path / "nodraft.gguf")],
             f"error: --llama-cpp-draft {tmp_path / 'nodraft.gguf'}: no such GGUF file"),
            (["--llama-cpp-draft", str(present)],
             f"error: --llama-cpp-draft {present}: needs --llama-cpp, the target it drafts for"),
            (["--llama-cpp", str(present)], "error: --llama-cpp: llama.cpp's tools are not built for this "
                                            "CPU")):
        with pytest.raises(SystemExit) as refused:
            bench.main(args + flags)
        assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)
    assert str(refused.value).endswith("run python -m bench.llama_cpp_tools (about 10 minutes)")
    assert not (tmp_path / "b.png").exists()


def test_bench_runs_llama_cpp_beside_the_engine(engine_dir, tmp_path):
    """llama.cpp's llama-server on the SmolLM2 GGUF, prompt by prompt between the engine's modes (the
    tiny engine's token ids are valid SmolLM2 ids; the text is not compared). It needs llama.cpp's
    tools built for this CPU (``python -m bench.llama_cpp_tools``), which CI does not build."""
    import importlib.util

    from bench.llama_cpp_tools import ToolsError, tools
    from modeling import demo_pair

    try:
        tools()
    except ToolsError as error:
        pytest.skip(str(error))
    if importlib.util.find_spec(demo_pair.TARGET_PACKAGE) is None:
        pytest.skip(f"{demo_pair.TARGET_PACKAGE} is not installed")
    gguf = demo_pair.target()
    engine = engine_dir(CLI_LIMITS, arch="llama")
    out = tmp_path / "bench.json"
    bench.main(["--engine", str(engine), "--prompts-file", str(_prompts(tmp_path)), "--limit", "2",
                "--max-new-tokens", "8", "--no-transformers", "--llama-cpp", str(gguf), "--threads", "1",
                "--out", str(out), "--plot", str(tmp_path / "bench.png")])
    report = json.loads(out.read_text())
    llama = report["runs"]["llama_cpp"]
    assert llama["gguf"] == str(gguf) and 0 < llama["tokens"] <= 16 and llama["tokens_per_second"] > 0
    assert report["ratios"]["target_only/llama_cpp"] > 0
    assert set(report["greedy_outputs_identical"]) == {"speculative == target_only"}
    agreement = report["llama_cpp_agreement"]
    assert agreement["prompts"] == 2 and 0 <= agreement["common_prefix_share"] <= 1


def test_agreement_with_llama_cpp_counts_identical_outputs_and_the_common_prefix():
    agreement = bench._agreement([[1, 2, 3], [4, 5], [7]], [[1, 2, 4, 9], [4, 5], [8]])
    assert agreement == {"identical_outputs": 1, "prompts": 3, "common_prefix_share": (2 + 2 + 0) / 7}


def _engine_with_draft_source(engine, tmp_path, source: dict) -> Path:
    """A copy of ``engine`` whose manifest.json names ``source`` as its draft checkpoint."""
    import shutil

    copy = Path(shutil.copytree(engine, tmp_path / "engine"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source"]["draft"] = {**manifest["source"]["draft"], **source}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _checked(engine, prompts, tmp_path, monkeypatch, *flags) -> dict:
    """``bench``'s checks on ``flags``, with the benchmark itself left out."""
    monkeypatch.setattr(bench, "run", lambda args, prompts: {"prompts": len(prompts)})
    args = bench.parser().parse_args(["--engine", str(engine), "--prompts-file", str(prompts), "--out",
                                      str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"), *flags])
    return bench.checked_run(args)


def test_prompts_a_draft_was_distilled_on_are_refused_unless_asked(engine_dir, tmp_path, monkeypatch):
    """The draft's training.json (which ``distill`` writes beside it) names the records it trained
    on, found by the prompt file's checksum wherever the file lies."""

    from common.prompts import TRAINING_RECORD, training_record

    prompts = _prompts(tmp_path)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / TRAINING_RECORD).write_text(json.dumps(training_record([(prompts, 2)], "test")))
    engine = _engine_with_draft_source(engine_dir(CLI_LIMITS, arch="llama"), tmp_path, {"path": str(draft)})
    with pytest.raises(SystemExit) as refused:
        _checked(engine, prompts, tmp_path, monkeypatch, "--skip", "1")
    assert str(refused.value) == (
        f"error: --prompts-file {prompts}: records 1-1 (--skip 1, --limit 8) are among records 0-1, which "
        f"the engine's draft was distilled on ({draft / TRAINING_RECORD}); pass --skip 2 for held-out ones, "
        f"or --allow-training-prompts to measure them anyway")
    assert not (tmp_path / "b.json").exists()
    assert _checked(engine, prompts, tmp_path, monkeypatch, "--skip", "2")["training_prompts"] == 0
    allowed = _checked(engine, prompts, tmp_path, monkeypatch, "--allow-training-prompts")
    assert allowed["training_prompts"] == 2
    # another file, or the same records of an edited one, is not the training data
    other = tmp_path / "other.jsonl"
    other.write_text(prompts.read_text() + json.dumps({"turns": ["one more"]}) + "\n")
    assert _checked(engine, other, tmp_path, monkeypatch)["training_prompts"] == 0
    (draft / TRAINING_RECORD).write_text(json.dumps({"prompts": [{"file": "x", "records": [0]}]}))
    with pytest.raises(SystemExit) as malformed:
        _checked(engine, prompts, tmp_path, monkeypatch)
    assert str(malformed.value).startswith(f"error: {draft / TRAINING_RECORD}: field 'prompts': expected")


def test_the_demo_drafts_training_prompts_are_recorded_and_refused(engine_dir, tmp_path, monkeypatch):
    """README's documented bench command (gsm8k from record 0) measured the demo draft on its own
    training prompts: the draft ships its training range, as its README's command made it, which
    holds for an engine of those weights built anywhere (found by their checksums)."""

    from common.manifest import file_hashes
    from common.prompts import read_jsonl_prompts
    from distill.options import DistillSpec
    from distill.prompts import _trained
    from modeling import demo_pair

    record = json.loads((demo_pair.DRAFT / "training.json").read_text())
    # as the command in the draft's README computes it: 180 per file, short of its last 20
    data = ROOT / "data" / "prompts"
    spec = DistillSpec(prompts=tuple(data / f for f in ("gsm8k.jsonl", "math500.jsonl", "humaneval.jsonl",
                                                        "mt-bench.jsonl")), num_prompts=180, held_out=20)
    assert [(ROOT / e["file"], range(*e["records"])) for e in record["prompts"]] == [
        (path, range(_trained(spec, path, read_jsonl_prompts(path, "")))) for path in spec.prompts]
    assert sum(len(range(*e["records"])) for e in record["prompts"]) == 564
    draft_files = file_hashes(demo_pair.DRAFT)
    assert record["draft_files"] == {name: draft_files[name] for name in ("config.json", "model.safetensors")}

    built_elsewhere = _engine_with_draft_source(
        engine_dir(CLI_LIMITS, arch="llama"), tmp_path,
        {"path": str(tmp_path / "gone"), "files": record["draft_files"]})
    with pytest.raises(SystemExit, match=r"records 0-7 \(--skip 0, --limit 8\) are among records 0-179.*"
                                         r"pass --skip 180 for held-out ones"):
        _checked(built_elsewhere, data / "gsm8k.jsonl", tmp_path, monkeypatch)
    assert _checked(built_elsewhere, data / "gsm8k.jsonl", tmp_path, monkeypatch, "--skip", "180") == {
        "prompts": 8, "training_prompts": 0}
