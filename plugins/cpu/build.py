"""Compile the CPU kernels (``plugins/qmatmul``, ``plugins/block_attention/cpu_kernel.cpp``,
``plugins/d2t_gather/cpu_kernel.cpp``) and
their ONNX Runtime ops (``ort_ops.cpp``) into one library for the machine it runs on:
``python -m plugins.cpu.build`` (what ``scripts/setup.sh`` runs), or on first use.

The library is built with ``-march=native``, so a build made on one CPU may die with SIGILL on
another; it is kept under a key of the sources, the compiler and this CPU's flags
(``$XDG_CACHE_HOME/dspark-trt``, default ``~/.cache``), and a machine that differs builds its own.
Where no compiler is found, or the CPU lacks AVX2, ``library()`` says so in one line and returns
None: the ONNX Runtime backend then runs its stock kernels.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[1]
SOURCES = (PLUGINS / "qmatmul" / "kernel.cpp", PLUGINS / "block_attention" / "cpu_kernel.cpp",
           PLUGINS / "d2t_gather" / "cpu_kernel.cpp", PLUGINS / "cpu" / "ort_ops.cpp")
HEADERS = (PLUGINS / "qmatmul" / "kernel.h", PLUGINS / "block_attention" / "cpu_kernel.h",
           PLUGINS / "d2t_gather" / "cpu_kernel.h", PLUGINS / "cpu" / "vec.h", PLUGINS / "cpu" / "ort_api.h")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark-trt"


def _compiler() -> str | None:
    """``$CXX`` where it is set, else g++ or c++."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    return next((found for name in names if (found := shutil.which(name))), None)


def _key(compiler: str) -> str:
    """The sources, the compiler's version and flags, and this CPU's instruction sets."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update(f"{version}{FLAGS}{cpu_flags()}".encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> str:
    """This CPU's instruction-set flags (``/proc/cpuinfo``'s line), what a native build depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def build(quiet: bool = False) -> Path | None:
    """The library for this machine, compiled unless already there; None, with one line on
    stderr, where it cannot be."""
    compiler = _compiler()
    if compiler is None:
        return _unavailable("no C++ compiler (g++) found", quiet)
    target = cache_dir() / f"libdspark_cpu-{_key(compiler)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)],
                                capture_output=True, text=True)
        if result.returncode:
            lines = result.stderr.strip().splitlines() or ["no output"]
            first = next((line for line in lines if "error" in line.lower()), lines[0])
            return _unavailable(f"{compiler} failed: {first}", quiet)
        built.replace(target)   # atomic: a concurrent first use sees the whole library or none
    return target


def _unavailable(why: str, quiet: bool) -> None:
    if not quiet:
        print(f"plugins/cpu: {why}; the engines run on ONNX Runtime's stock kernels (slower rows, "
              f"one call per sequence)", file=sys.stderr)
    return None


@cache
def library() -> Path | None:
    """``build()``, once per process (disabled, ``DSPARK_CPU_KERNELS=0``: None, silently)."""
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0":
        return None
    return build()


if __name__ == "__main__":
    path = build()
    if path is None:
        sys.exit(0)   # setup goes on: the stock kernels run instead
    print(f"plugins/cpu: built for this CPU: {path}")
