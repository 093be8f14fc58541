"""``manifest.json`` against ``common/manifest.schema.json``: what build writes is valid, and a
manifest of the wrong shape (a field missing, of the wrong type or out of range) is refused by
``common.manifest.read`` with one line that names manifest.json, the field's JSON path and what was
expected, before any reader can trip over it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import export.__main__ as export_cli
from common import manifest

from conftest import ENGINE_CASES, LIMITS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=ENGINE_CASES)
def engine(request, engine_dir) -> tuple[Path, dict]:
    directory = engine_dir(LIMITS, **ENGINE_CASES[request.param])
    return directory, json.loads((directory / "manifest.json").read_text())


@pytest.fixture
def built(engine) -> dict:
    return engine[1]


def engine_with(tmp_path: Path, content) -> Path:
    """An engine directory whose manifest.json holds ``content`` (JSON-encoded)."""
    (tmp_path / "manifest.json").write_text(json.dumps(content))
    return tmp_path


def refusal(directory: Path) -> str:
    with pytest.raises(manifest.ManifestError) as info:
        manifest.read(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory / "manifest.json") in message, message
    return message


def test_the_schema_is_a_valid_json_schema():
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(json.loads(manifest.SCHEMA.read_text()))


def test_built_manifests_match_the_schema(built, tmp_path):
    assert manifest.violation(built) is None
    assert manifest.read(engine_with(tmp_path, built)) == built


def test_a_tensorrt_section_as_build_engines_writes_it_matches_the_schema(engine, tmp_path, monkeypatch):
    """``trt_build.build_engines`` run on the built graphs with only TensorRT's build itself replaced,
    and its entry added as ``build`` adds it (test_tensorrt_build.py builds real engines, whose
    manifests ``write`` checks)."""
    pytest.importorskip("tensorrt_rtx")
    from export import trt_build

    directory, built = engine
    for graph in built["graphs"].values():
        shutil.copy(directory / graph["file"], tmp_path)

    def fake_build(trt, logger, onnx_path, profiles, gpu, cache_path, engine_path):
        engine_path.write_bytes(b"engine")
        return trt_build._onnx_nodes(onnx_path)[0]   # the plugin layers a real build finds

    monkeypatch.setattr(trt_build, "_build", fake_build)
    entry = trt_build.build_engines(tmp_path, built, "trt-rtx", ["sm89", "sm120"])
    with_rtx = {**built, "backends": [*built["backends"], "trt-rtx"],
                "tools": {**built["tools"], "trt-rtx": entry.pop("version")}, "trt-rtx": entry}
    with_rtx = json.loads(json.dumps(with_rtx))  # as manifest.write writes it
    assert manifest.violation(with_rtx) is None
    without_section = {k: v for k, v in with_rtx.items() if k != "trt-rtx"}
    assert manifest.violation(without_section) == "$: 'trt-rtx' is a required property"


WRONG_SHAPES = {  # name: (the manifest made from a built one, the JSON path, what is said)
    "a list": (lambda m: [1, 2, 3], "$", "[1, 2, 3] is not of type 'object'"),
    "no limits": (lambda m: {k: v for k, v in m.items() if k != "limits"}, "$",
                  "'limits' is a required property"),
    "max_batch a string": (lambda m: m | {"limits": m["limits"] | {"max_batch": "4"}},
                           "$.limits.max_batch", "'4' is not of type 'integer'"),
    "max_batch 0": (lambda m: m | {"limits": m["limits"] | {"max_batch": 0}},
                    "$.limits.max_batch", "0 is less than the minimum of 1"),
    "schema_version 0": (lambda m: m | {"schema_version": 0}, "$.schema_version", "expected 3, got 0"),
    "schema_version '3'": (lambda m: m | {"schema_version": "3"}, "$.schema_version", "expected 3, got '3'"),
    "schema_version 1 (before logit_rows)": (lambda m: m | {"schema_version": 1}, "$.schema_version",
                                             "expected 3, got 1"),
    "schema_version 2 (the draft's noise over its own ids)": (
        lambda m: m | {"schema_version": 2}, "$.schema_version", "expected 3, got 2"),
    "schema_version true": (lambda m: m | {"schema_version": True}, "$.schema_version",
                            "expected 3, got True"),
    "dtype int8": (lambda m: m | {"dtype": "int8"}, "$.dtype", "'int8' is not one of"),
    "a target graph built before logit_rows": (
        lambda m: m | {"graphs": m["graphs"] | {"target": m["graphs"]["target"] | {
            "inputs": [t for t in m["graphs"]["target"]["inputs"] if t["name"] != "logit_rows"]}}},
        "$.graphs.target.inputs[2].name", "expected 'logit_rows', got 'k_cache_0'"),
}


@pytest.mark.parametrize("case", WRONG_SHAPES)
def test_a_manifest_of_the_wrong_shape_is_one_line(built, tmp_path, case):
    make, where, expected = WRONG_SHAPES[case]
    message = refusal(engine_with(tmp_path, make(built)))
    assert f"manifest.json: {where}: {expected}" in message and "rebuild" in message


def test_inspect_names_the_bad_field_in_one_line(built, tmp_path):
    broken = json.loads(json.dumps(built))
    broken["limits"]["max_batch"] = "4"
    with pytest.raises(SystemExit) as info:
        export_cli.main(["inspect", str(engine_with(tmp_path, broken))])
    assert str(info.value).startswith("error: ") and "$.limits.max_batch" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("version", [4, 99])
def test_a_future_schema_version_says_upgrade(built, tmp_path, version):
    """Whatever else a newer manifest holds, it is refused as newer, not as malformed."""
    message = refusal(engine_with(tmp_path, {**built, "schema_version": version, "new_field": 1}))
    assert f"schema_version {version} is newer than this dspark-trt understands" in message


def wrong_type(value):
    """A JSON value of another type than ``value``'s."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, (int, float)):
        return "1"
    if isinstance(value, str):
        return 1.5  # not 1: a shape's axis may be a name or a size
    if isinstance(value, dict):
        return []
    return {}  # list or null


def fields(node, path=()):
    """Paths to every field of ``node``, and to the first item of each list (the schema gives all
    items of a list one type)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key), value
            yield from fields(value, (*path, key))
    elif isinstance(node, list) and node:
        yield (*path, 0), node[0]
        yield from fields(node[0], (*path, 0))


def json_path(path: tuple) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


# maps whose keys are names (files, tool versions) and the fields old engines lack
FREE_KEYS = {("source", "target", "files"), ("source", "draft", "files"), ("tools",)}
# absent in engines built before them; ``linear`` / ``moe`` / ``gemma4`` are null for a dense target
OPTIONAL = {("draft", "confidence_threshold"), ("draft", "logit_scale"), ("draft", "architecture"),
            ("draft", "markov_top_k"),
            ("weights",), ("target", "linear"), ("target", "moe"), ("target", "gemma4"), ("draft", "gemma4")}


def test_every_field_is_typed_and_required(engine_dir):
    """Each field of a built manifest set to a value of another type, and each field deleted, is
    refused naming the field (deleted: its parent and its name). One engine: both have the same
    fields."""
    directory = engine_dir(LIMITS, **ENGINE_CASES["qwen3-native"])
    built = json.loads((directory / "manifest.json").read_text())
    problems = []
    for path, value in fields(built):
        parent, key = path[:-1], path[-1]
        mutations = [("wrong type", wrong_type(value))]
        if not isinstance(key, int) and parent not in FREE_KEYS and path not in OPTIONAL:
            mutations.append(("deleted", None))
        for mutation, new in mutations:
            edited = json.loads(json.dumps(built))
            node = edited
            for step in parent:
                node = node[step]
            if mutation == "deleted":
                del node[key]
            else:
                node[key] = new
            problem = manifest.violation(edited)
            if problem is None or not problem.startswith(json_path(parent)) or "\n" in problem:
                problems.append(f"{json_path(path)} {mutation}: {problem or 'accepted'}")
    assert not problems, "\n".join(problems)


def test_write_refuses_what_the_schema_refuses(built, tmp_path):
    broken = {k: v for k, v in built.items() if k not in ("schema_version", "limits")}
    with pytest.raises(manifest.ManifestError, match=r"\$: 'limits' is a required property; not written"):
        manifest.write(tmp_path, broken)
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.slow
def test_the_package_ships_the_schema_and_the_demo_draft(tmp_path):
    """A wheel of the project holds the schema ``read`` needs, the distill package and the demo
    pair's draft, and setuptools has nothing to warn about the data folders (modeling.drafts)."""
    pytest.importorskip("setuptools", reason="builds the wheel offline, with the setuptools installed here")
    source = tmp_path / "source"
    for package in ("common", "modeling", "export", "distill", "runtime", "plugins"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                             "--no-build-isolation", "-w", str(tmp_path / "wheel")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "absent from the `packages` configuration" not in result.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"common/manifest.schema.json", "distill/__main__.py"} <= names
    assert {"modeling/drafts/smollm2-135m-instruct/config.json",
            "modeling/drafts/smollm2-135m-instruct/model.safetensors"} <= names
