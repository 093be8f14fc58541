"""llama.cpp as ``python -m bench``'s outside baseline: greedy decoding of the same token ids through
llama.cpp's own ``llama-server`` on a GGUF file, target-only and, given the draft converted by its
converter, with its DSpark (``--spec-type draft-dspark``).

The server is llama.cpp's own build for this CPU (``python -m bench.llama_cpp_tools``), a process of
its own: llama.cpp's thread pool and ONNX Runtime's would compete in one. The bench sends one prompt
at a time, between its own modes, so a slow spell of a shared machine falls on all of them alike.
A prompt goes as token ids to ``/completion`` (temperature 0, the prompt cache off); the seconds are
the server's own ``prompt_ms + predicted_ms``, the decoding with its prompt, not the HTTP around it.
Between its requests the server is stopped (``SIGSTOP``): its idle threads poll for work, which took
a core from the engine's runs beside it, and polling less made llama.cpp slower (tg32 48 against
54 tokens/s with ``--poll 0``).
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.llama_cpp_tools import ToolsError, tools

STARTUP_SECONDS = 300


def check(gguf: Path, draft: Path | None = None) -> None:
    """Refuse, before any benchmark work, a baseline that cannot run."""
    for flag, path in (("--llama-cpp", gguf), ("--llama-cpp-draft", draft)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} {path}: no such GGUF file")
    if draft is not None and gguf is None:
        raise ValueError(f"--llama-cpp-draft {draft}: needs --llama-cpp, the target it drafts for")
    try:
        tools()
    except ToolsError as error:
        raise ValueError(f"--llama-cpp: {error}") from None


class LlamaServer:
    """``llama-server`` on a free port of 127.0.0.1, started on entering and stopped on leaving;
    with ``draft``, llama.cpp's DSpark drafting ``drafts`` tokens a step at most (confidence cut
    off: ``--spec-draft-p-min 0``)."""

    def __init__(self, gguf: Path, threads: int, context: int, draft: Path | None = None, drafts: int = 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.gguf, self.draft = gguf, draft
        self.command = [str(tools().server), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                        "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port)]
        if draft is not None:
            self.command += ["-md", str(draft), "--spec-type", "draft-dspark", "--spec-draft-n-max",
                             str(drafts), "--spec-draft-p-min", "0", "-td", str(threads)]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                last = (self.process.stderr.read().strip().splitlines() or ["(no output)"])[-1]
                raise ValueError(f"--llama-cpp {self.gguf}: llama-server stopped (exit status "
                                 f"{self.process.returncode}): {last}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        self.process.send_signal(signal.SIGSTOP)
                        return self
            except OSError:   # not listening yet, or 503 while it loads (HTTPError is an OSError)
                time.sleep(0.25)
        self.__exit__()
        raise ValueError(f"--llama-cpp {self.gguf}: llama-server did not answer in {STARTUP_SECONDS} s")

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def generate(self, ids: list[int], max_new_tokens: int, stop: list[int] | None) -> dict:
        """Greedy new tokens for ``ids``, as ``{"token_ids", "seconds", "decode_seconds", "drafted",
        "accepted"}`` (seconds with the prompt's, and without; draft tokens its steps verified, and of
        them accepted). It stops after an end-of-generation id as the engine does with ``stop`` (the
        engine's end ids), or with ``stop`` None only at ``max_new_tokens``."""
        request = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "top_k": 1,
                   "cache_prompt": False, "return_tokens": True, "stream": False,
                   "ignore_eos": stop is None}
        post = urllib.request.Request(f"{self.url}/completion", json.dumps(request).encode(),
                                      {"Content-Type": "application/json"})
        self.process.send_signal(signal.SIGCONT)
        try:
            with urllib.request.urlopen(post) as reply:
                answer = json.loads(reply.read())
        finally:
            self.process.send_signal(signal.SIGSTOP)
        timings = answer["timings"]
        seconds = (timings["prompt_ms"] + timings["predicted_ms"]) / 1e3
        return {"token_ids": answer["tokens"], "seconds": seconds,
                "decode_seconds": timings["predicted_ms"] / 1e3, "drafted": timings.get("draft_n", 0),
                "accepted": timings.get("draft_n_accepted", 0)}
