"""``python -m runtime.bench`` on a tiny engine: the report, its invariant checks, and the plot."""
import json

from export.onnx_export import Limits
from runtime import bench


def test_bench_reports_and_plots(engine_dir, tmp_path):
    engine = engine_dir(Limits(max_batch=2, max_seq_len=128, max_prompt_chunk=32), arch="llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in ("the cat", "two plus two", "hi")))
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    bench.main(["--engine", str(engine), "--prompts-file", str(prompts), "--limit", "2",
                "--max-new-tokens", "16", "--prompt-lookup", "3", "--out", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert report["prompts"] == 2
    runs = report["runs"]
    assert set(runs) == {"speculative", "target_only", "transformers", "transformers_prompt_lookup"}
    assert all(r["tokens"] > 0 and r["tokens_per_second"] > 0 for r in runs.values())
    assert len(runs["speculative"]["acceptance_per_position"]) == 4 and runs["target_only"]["tau"] == 1.0
    assert 0 < runs["speculative"]["host_fraction"] < 1
    # greedy: every method produced the same tokens as speculative decoding
    assert report["greedy_outputs_identical"] and all(report["greedy_outputs_identical"].values())
    assert report["ratios"]["speculative/target_only"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
