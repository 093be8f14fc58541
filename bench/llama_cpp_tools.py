"""llama.cpp's own tools, built for this CPU: the baseline every comparison of ours runs against.

``python -m bench.llama_cpp_tools`` downloads the ``llama-cpp-python`` sdist (``pip download
--no-binary``), whose ``vendor/llama.cpp`` is a whole llama.cpp with DSpark (``--spec-type
draft-dspark``), and builds ``llama-server``, ``llama-bench`` and ``llama-quantize`` from it with
``-DGGML_NATIVE=ON`` (about 10 minutes on 2 cores). Its ``convert_hf_to_gguf.py`` (with the
``gguf-py`` beside it) turns Hugging Face checkpoints, DSpark drafts included, into GGUF files.

A native build runs only on the CPU it was built for, so the build is cached by sdist version, this
CPU's instruction-set flags and the compiler, beside the compiled CPU kernels (``plugins/cpu/build.py``,
whose cache folder and flags it reads): a machine of another kind builds its own. AMX is off (its
kernels crashed in the first decode on the Xeons this was built on, and ``GGML_NATIVE`` turns it
back on unless the compiler is told ``-mno-amx-*`` too).

``python -m bench.llama_cpp_tools draft DRAFT TARGET OUT.gguf`` converts a DSpark draft for llama.cpp's
DSpark (``--spec-type draft-dspark``). The converter reads the draft's target as a Hugging Face folder;
a GGUF target is written as one first (``transformers`` de-quantizes the file), beside ``OUT``.

This is a benchmark dependency, never a runtime one: nothing in ``runtime`` or ``export`` imports it.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from plugins.cpu.build import cache_dir, cpu_flags

VERSION = "0.3.36"   # llama-cpp-python's sdist; its vendor/llama.cpp has DSpark (llama.cpp PR #25173)
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
BUILD = "python -m bench.llama_cpp_tools"


class ToolsError(ValueError):
    """One line: why the tools are not there, and what builds them."""


@dataclass(frozen=True)
class Tools:
    """Paths of one build's programs and of its converter."""

    root: Path   # the vendored llama.cpp source tree

    @property
    def bin(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin / "llama-server"

    @property
    def bench(self) -> Path:
        return self.bin / "llama-bench"

    @property
    def quantize(self) -> Path:
        return self.bin / "llama-quantize"

    @property
    def converter(self) -> Path:
        return self.root / "convert_hf_to_gguf.py"

    def convert(self, model: Path, out: Path, *extra: str, outtype: str = "f16",
                pre_tokenizer: str | None = None) -> Path:
        """Run llama.cpp's converter on a Hugging Face folder (``extra``: e.g. ``--target-model-dir
        DIR`` for a DSpark draft); ``pre_tokenizer`` pins the tokenizer's pre-tokenizer where the
        converter does not know it (``bench/llama_cpp_convert.py``)."""
        command = [sys.executable, "-m", "bench.llama_cpp_convert", str(self.root), pre_tokenizer or "-",
                   str(model), "--outfile", str(out), "--outtype", outtype, *extra]
        _run(command, what=f"convert_hf_to_gguf.py {model}", cwd=Path(__file__).resolve().parents[1])
        return out

    def quantize_file(self, source: Path, out: Path, kind: str, *extra: str) -> Path:
        """``llama-quantize [extra] SOURCE OUT KIND`` (``extra``: e.g. ``--token-embedding-type q8_0``)."""
        _run([str(self.quantize), *extra, str(source), str(out), kind], what=f"llama-quantize {source}")
        return out


def home() -> Path:
    """This CPU's build folder, beside the compiled CPU kernels (``plugins/cpu/build.py``): keyed by
    the sdist's version, this CPU's instruction-set flags and the compiler, as the kernels are."""
    key = hashlib.sha256(f"{cpu_flags()}\n{shutil.which('c++') or ''}".encode()).hexdigest()[:12]
    return cache_dir() / "llama.cpp" / f"{VERSION}-{key}"


def tools() -> Tools:
    """This CPU's build, or a one-line ``ToolsError`` that says how to make it."""
    found = Tools(home() / "llama.cpp")
    missing = [p.name for p in (found.server, found.bench, found.quantize, found.converter) if not p.exists()]
    if missing:
        raise ToolsError(f"llama.cpp's tools are not built for this CPU ({', '.join(missing)} missing under "
                         f"{found.root}): run {BUILD} (about 10 minutes)")
    return found


def build(log=print) -> Tools:
    """Download the sdist, unpack its ``vendor/llama.cpp`` and build the targets (cached)."""
    try:
        return tools()
    except ToolsError:
        pass
    for program in ("cmake", "c++", "ninja"):
        if shutil.which(program) is None:
            raise ToolsError(f"building llama.cpp needs {program}, which is not on PATH")
    folder = home()
    source = folder / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            log(f"downloading llama-cpp-python {VERSION}'s sdist")
            _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                  f"llama-cpp-python=={VERSION}", "-d", scratch], what="pip download llama-cpp-python")
            sdist = next(Path(scratch).glob("*.tar.gz"))
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            with tarfile.open(sdist) as archive:
                members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
                for member in members:
                    member.name = member.name[len(prefix):]
                archive.extractall(scratch + "/llama.cpp", members=[m for m in members if m.name],
                                   filter="data")
            shutil.rmtree(source, ignore_errors=True)
            os.replace(scratch + "/llama.cpp", source)
    log(f"building {', '.join(TARGETS)} in {source / 'build'} for this CPU (about 10 minutes)")
    _run(["cmake", "-S", str(source), "-B", str(source / "build"), "-G", "Ninja", *CMAKE_FLAGS],
         what="cmake (configure llama.cpp)")
    _run(["cmake", "--build", str(source / "build"), "--target", *TARGETS], what="cmake --build (llama.cpp)")
    return tools()


def convert_draft(draft: Path, target: Path, out: Path, pre_tokenizer: str | None = None) -> Path:
    """``draft`` (a DSpark checkpoint folder) as llama.cpp's converter writes it, for ``target`` (a
    Hugging Face folder, or a GGUF file, written as a folder beside ``out`` first)."""
    if target.suffix == ".gguf":
        folder = out.with_name(f"{out.stem}.target")
        if not (folder / "config.json").exists():
            hf_folder(target, folder)
        target = folder
    return tools().convert(draft, out, "--target-model-dir", str(target), pre_tokenizer=pre_tokenizer)


def hf_folder(gguf: Path, out: Path) -> Path:
    """A GGUF file as a Hugging Face folder: ``transformers`` loads it de-quantized and saves it,
    without the ``quantization_config`` that names the file (a saved folder has no file to name)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def _run(command: list[str], what: str, cwd: Path | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        last = [line for line in done.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
        raise ToolsError(f"{what} failed (exit status {done.returncode}): {last[0].strip()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=BUILD, description=__doc__.split("\n\n")[0])
    p.add_argument("--print", action="store_true",
                   help="print the build's bin folder if it is built, else fail (builds nothing)")
    commands = p.add_subparsers(dest="command")
    draft = commands.add_parser("draft", help="convert a DSpark draft for llama.cpp's DSpark")
    draft.add_argument("draft", type=Path, help="the draft's checkpoint folder")
    draft.add_argument("target", type=Path, help="its target: a Hugging Face folder or a .gguf file")
    draft.add_argument("out", type=Path, help="the GGUF file to write")
    draft.add_argument("--pre-tokenizer",
                       help="pin the converter's pre-tokenizer (qwen2 for make-tiny --preset pairs, whose "
                            "tokenizer it does not know)")
    args = p.parse_args(argv)
    try:
        if args.command == "draft":
            print(convert_draft(args.draft, args.target, args.out, args.pre_tokenizer))
            return 0
        found = tools() if args.print else build(log=lambda line: print(line, file=sys.stderr))
    except ToolsError as error:
        print(f"{BUILD}: {error}", file=sys.stderr)
        return 1
    print(found.bin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
