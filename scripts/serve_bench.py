"""Load benchmark of ``runtime.serve`` on 127.0.0.1: N concurrent streaming clients (N = 1, 2, 4,
8 by default) against the server with its measured draft schedule, the same server target-only
(``--draft-schedule 0``) and, on the same GGUF file, llama.cpp's own ``llama-server`` with as many
slots as the engine (``-np``, continuous batching; built by ``python -m bench.llama_cpp_tools``); and
``Generator`` in this process on the same prompts, one at a time, as the no-server baseline.

Every server runs at once on its own port with the same threads; only one is under load at a
time, the others stopped (``SIGSTOP``: llama-server's idle threads poll for work and took a core).
Each pass runs every concurrency against every server in turn (the order rotating), and
``--repeat`` passes give each figure as a median with its spread. Prompts are sent as text to
``/v1/completions`` with the chat template applied here, so every server reads the same text.
Per run: total tokens/s (all tokens over the run's wall time), time to first token p50 / p95 and
per-request tokens/s; for our servers also tau and drafts per step from ``/metrics``. Greedy:
our servers' texts must equal ``Generator``'s (checked, reported).

    python scripts/serve_bench.py --engine engines/smollm2-135m-instruct \\
        --llama-cpp "$(python -c 'from modeling import demo_pair; print(demo_pair.target())')" \\
        --skip 180 --limit 16 --threads 2 --out docs/bench/serve.json --plot docs/bench/serve.png
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(name: str, command: list[str], ready_path: str, port: int, log: Path):
    """A server process, up when ``ready_path`` answers 200: ``(url, process)``; ended (SIGTERM)
    on exit, resumed first if it was stopped."""
    out = log.open("w")
    process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(url + ready_path, timeout=2)
            break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if process.poll() is not None or time.time() > deadline:
                process.kill()
                raise SystemExit(f"{name} did not start; its output is in {log}")
            time.sleep(0.5)
    try:
        yield url, process
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        out.close()


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: its text, token count, time to first token and duration."""
    begin = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].text)
            chunks += 1
    end = time.perf_counter()
    return {"text": "".join(pieces), "tokens": usage if usage is not None else chunks,
            "ttft": (first or end) - begin, "seconds": end - begin}


def load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int, request=None) -> dict:
    """``clients`` threads, each sending requests one after another until ``prompts`` is used up;
    ``request(prompt)`` sends one (default: a streamed OpenAI completion to ``url``)."""
    import openai

    if request is None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        def request(prompt):
            return one_request(client, model, prompt, max_tokens)
    results: list[dict | None] = [None] * len(prompts)
    cursor = iter(range(len(prompts)))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            results[index] = request(prompts[index])

    begin = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begin
    ttfts = sorted(r["ttft"] for r in results)
    return {"total_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "request_tok_s": statistics.median(r["tokens"] / r["seconds"] for r in results),
            "texts": [r["text"] for r in results], "tokens": sum(r["tokens"] for r in results)}


def chat_prompts(generator, args) -> list[str]:
    """``--limit`` held-out prompts from ``--skip`` on, through the chat template here, so that
    every server reads the same text."""
    from common.prompts import read_jsonl_prompts

    texts = read_jsonl_prompts(args.prompts_file, "--prompts-file")[args.skip:][:args.limit]
    return [generator.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                    add_generation_prompt=True) for t in texts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--llama-cpp", type=Path, metavar="GGUF", help="also llama.cpp's llama-server on it")
    p.add_argument("--prompts-file", type=Path, default=ROOT / "data" / "prompts" / "gsm8k.jsonl")
    p.add_argument("--skip", type=int, default=180, help="held-out records from here [180]")
    p.add_argument("--limit", type=int, default=16, help="requests per run [16]")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--draft-schedule", action="append", default=[],
                   help="a speculative server with this schedule (repeatable) [one, measured at its start]")
    p.add_argument("--out", type=Path, default=Path("serve_bench.json"))
    p.add_argument("--plot", type=Path, default=Path("serve_bench.png"))
    args = p.parse_args()

    from runtime import Generator

    generator = Generator.from_engine(args.engine, threads=args.threads)
    prompts, clients = chat_prompts(generator, args), [int(n) for n in args.clients.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="serve_bench_"))   # each server's output, for when one fails
    print(f"server logs: {logs}", flush=True)
    ours = [sys.executable, "-m", "runtime.serve", "--engine", str(args.engine), "--threads",
            str(args.threads), "--model", "m", "--max-queue", "1024"]
    commands = {f"speculative {schedule}": ours + ["--draft-schedule", schedule]
                for schedule in args.draft_schedule} or {"speculative": ours}
    commands["target-only"] = ours + ["--draft-schedule", "0"]
    if args.llama_cpp:
        from bench.llama_cpp_tools import tools

        limits = generator.backend.limits   # as many slots as the engine, each with its capacity
        commands["llama.cpp"] = [str(tools().server), "-m", str(args.llama_cpp), "-t", str(args.threads),
                                 "-tb", str(args.threads), "-np", str(limits.max_batch),
                                 "-c", str(limits.capacity * limits.max_batch), "--alias", "m",
                                 "--host", "127.0.0.1"]
    runs: dict = {name: {n: [] for n in clients} for name in commands}
    runs["generate"] = []
    with ExitStack() as stack:
        urls, processes = {}, {}
        for name, command in commands.items():
            port = free_port()
            urls[name], processes[name] = stack.enter_context(server(name, command + ["--port", str(port)],
                                                                     "/health", port, logs / f"{name}.log"))
            processes[name].send_signal(signal.SIGSTOP)
        names = list(commands)
        reference = None
        for repeat in range(args.repeat):
            begin = time.perf_counter()   # the no-server baseline: one prompt at a time
            made = [generator.generate(t, chat_template=False, max_new_tokens=args.max_tokens)
                    for t in prompts]
            wall = time.perf_counter() - begin
            reference = [m.texts[0] for m in made]
            runs["generate"].append(sum(len(m.token_ids[0]) for m in made) / wall)
            for n in clients:
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    processes[name].send_signal(signal.SIGCONT)
                    before = metrics(urls[name]) if name != "llama.cpp" else None
                    run = load(urls[name], "m", prompts, n, args.max_tokens)
                    if before is not None:
                        after = metrics(urls[name])
                        gained = {k: after[k] - before.get(k, 0) for k in after}
                        drafts = gained["dspark:spec_decode_num_drafts_total"]
                        run["verify_steps"] = drafts
                        run["tau"] = (1 + gained["dspark:spec_decode_num_accepted_tokens_total"] / drafts
                                      if drafts else None)
                        run["drafts_per_step"] = (gained["dspark:spec_decode_num_draft_tokens_total"] / drafts
                                                  if drafts else 0.0)
                        run["exact"] = run["texts"] == reference
                    processes[name].send_signal(signal.SIGSTOP)
                    runs[name][n].append(run)
                    print(f"pass {repeat + 1} {name:12s} N={n}: {run['total_tok_s']:6.1f} tok/s total, "
                          f"TTFT p50 {run['ttft_p50']:.2f} s p95 {run['ttft_p95']:.2f} s"
                          + (f", tau {run['tau']:.2f}" if run.get("tau") else "")
                          + ("" if run.get("exact", True) else ", OUTPUT DIFFERS"), flush=True)
    report = summarize(runs, clients, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, clients, args.plot)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


def summarize(runs: dict, clients: list[int], args) -> dict:
    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    table = {}
    for name, by_n in runs.items():
        if name == "generate":
            continue
        table[name] = {}
        for n in clients:
            rs = by_n[n]
            row = {key: spread([r[key] for r in rs]) for key in ("total_tok_s", "ttft_p50", "ttft_p95",
                                                                 "request_tok_s")}
            if "tau" in rs[0]:
                row["tau"] = rs[0]["tau"] and statistics.median(r["tau"] for r in rs)
                row["drafts_per_step"] = statistics.median(r["drafts_per_step"] for r in rs)
                row["exact"] = all(r["exact"] for r in rs)
            table[name][n] = row
    return {"date": time.strftime("%Y-%m-%d"), "engine": str(args.engine), "threads": args.threads,
            "requests": args.limit, "max_tokens": args.max_tokens, "prompts": f"{args.prompts_file.name} "
            f"records {args.skip}..{args.skip + args.limit - 1}", "generate_tok_s": spread(runs["generate"]),
            "table": table, "runs": {name: {str(n): [{k: v for k, v in r.items() if k != "texts"} for r in rs]
                                            for n, rs in by_n.items()} for name, by_n in runs.items()
                                     if name != "generate"}}


def plot(report: dict, clients: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in report["table"].items():
        total = [rows[n]["total_tok_s"] for n in clients]
        left.errorbar(clients, [t["median"] for t in total], marker="o", label=name,
                      yerr=[[t["median"] - t["min"] for t in total], [t["max"] - t["median"] for t in total]])
        right.plot(clients, [rows[n]["ttft_p95"]["median"] for n in clients], marker="o", label=name)
    if report["generate_tok_s"]["median"]:
        left.axhline(report["generate_tok_s"]["median"], color="gray", ls=":",
                     label="runtime.generate (1 at a time)")
    left.set(xlabel="concurrent clients", ylabel="total tokens/s", xscale="log", xticks=clients,
             xticklabels=clients, title="throughput")
    right.set(xlabel="concurrent clients", ylabel="seconds", xscale="log", xticks=clients,
              xticklabels=clients, title="time to first token, p95")
    for ax in (left, right):
        ax.minorticks_off()
    left.legend(fontsize=8)
    fig.suptitle(f"{Path(report['engine']).name}, {report['threads']} threads, {report['date']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
