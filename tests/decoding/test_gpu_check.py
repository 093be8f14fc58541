"""``scripts/gpu_check.py`` on a CPU: its step logic, so that the few minutes a lent GPU gives are
not spent on a crash (TensorRT-RTX does not target the H200 that may be lent)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_tensorrt_rtx_is_skipped_on_hopper_and_targets_other_gpus():
    pytest.importorskip("tensorrt_rtx")
    with pytest.raises(gpu_check.Skipped, match="TensorRT-RTX does not build for sm90"):
        gpu_check.engine_gpus("trt-rtx", (9, 0))
    assert gpu_check.engine_gpus("trt-rtx", (8, 9)) == ("sm89",)


def test_every_step_runs_and_reports_one_line(capsys):
    def fails():
        raise RuntimeError("engine differs\nfrom ORT")

    def skips():
        raise gpu_check.Skipped("tensorrt is not importable")

    ok = gpu_check.run_steps({"a": lambda: "fine", "b": fails, "c": skips, "d": lambda: "also fine"})
    lines = capsys.readouterr().out.splitlines()
    assert not ok
    assert [line.split(" (")[0] for line in lines] == [
        "a: passed: fine", "b: FAILED: RuntimeError: engine differs from ORT",
        "c: skipped: tensorrt is not importable", "d: passed: also fine"]
    assert gpu_check.run_steps({"a": lambda: "fine", "c": skips})
