"""llama.cpp as ``python -m bench``'s outside baseline: greedy decoding of the same token ids through
``llama-cpp-python`` on a GGUF file, in a worker process of its own.

Its own process because llama.cpp's OpenMP thread pool and ONNX Runtime's / torch's compete when
they share one (in one process it measured 45 tokens/s where alone it gave 60-67). The bench sends
one prompt at a time, between its own modes, so a slow spell of a shared machine falls on all of
them alike. The worker reads JSON lines ``{"ids": [...], "max_new_tokens": N, "stop": [...]}`` on
stdin (``stop``: the engine's end-of-sequence ids, so both stop alike) and answers
``{"token_ids": [...], "seconds": s}``, timing only the decoding (prompt included).

``pip install llama-cpp-python`` compiles llama.cpp for the CPU it is built on, and its default
build uses AMX kernels that crash in the first decode on the CPUs we test on. Machines of one kind
differ (some have AVX-512, some only AVX2), and a build for one can stop on another with an illegal
instruction, so build where it runs, e.g. for AVX2: ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
-DGGML_AMX_BF16=OFF" pip install llama-cpp-python`` (add ``-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON``
where ``/proc/cpuinfo`` lists ``avx512f``).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

INSTALL = "pip install llama-cpp-python, built for this CPU (see bench/llama_cpp_baseline.py)"


def check(gguf: Path) -> None:
    """Refuse, before any benchmark work, a baseline that cannot run."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError(f"--llama-cpp needs llama-cpp-python: {INSTALL}")
    if not gguf.is_file():
        raise ValueError(f"--llama-cpp {gguf}: no such GGUF file")


class LlamaCpp:
    """The worker process, started on entering and stopped on leaving."""

    def __init__(self, gguf: Path, threads: int | None, context: int):
        self.gguf = gguf
        self.command = [sys.executable, "-m", "bench.llama_cpp_baseline", str(gguf), str(context)]
        self.command += [str(threads)] if threads else []

    def __enter__(self) -> "LlamaCpp":
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=Path(__file__).resolve().parents[1])
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        self.process.wait()

    def generate(self, ids: list[int], max_new_tokens: int, stop: list[int]) -> tuple[list[int], float]:
        """Greedy new tokens for ``ids`` (up to and including a ``stop`` id) and the seconds the
        worker spent decoding them."""
        request = {"ids": ids, "max_new_tokens": max_new_tokens, "stop": stop}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:   # it stopped before reading
            line = ""
        if not line:
            status = self.process.wait()
            hint = (": llama-cpp-python was built for another CPU (an illegal instruction); rebuild it "
                    "with the CMAKE_ARGS in bench/llama_cpp_baseline.py" if status in (-4, 132) else "")
            raise ValueError(f"--llama-cpp {self.gguf}: the llama.cpp worker stopped (exit status "
                             f"{status}){hint}")
        answer = json.loads(line)
        return answer["token_ids"], answer["seconds"]


def serve(gguf: str, context: int, threads: int | None) -> None:
    from llama_cpp import Llama

    model = Llama(gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    next(model.generate([model.token_bos()], temp=0.0, top_k=1))   # touches the weights once
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        tokens = []
        for token in model.generate(request["ids"], temp=0.0, top_k=1, reset=True):
            tokens.append(token)
            if token in request["stop"] or len(tokens) == request["max_new_tokens"]:
                break
        seconds = time.perf_counter() - started
        print(json.dumps({"token_ids": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
