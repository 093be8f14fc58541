"""Load benchmark of the deployment paths on 127.0.0.1: the same N-client streaming load as
``serve_bench.py`` through ``runtime.serve``, through Triton Inference Server's ``generate_stream``
(``export triton-repo``, ``scripts/tritonserver.sh``) and through Ray Serve with 1 and with 2
replicas (one Ray cluster, the two applications side by side:
``runtime.serving.ray_serve.application``).

``runtime.serve`` and Triton run the engine on ``--threads`` threads; each Ray replica on
``--replica-threads``. Every server is up at once and only one is under load at a time, the order
rotating over ``--repeat`` passes; figures are medians with their spread. Greedy: every path's
texts must equal ``runtime.serve``'s (checked, reported).

    python scripts/deploy_bench.py --engine engines/smollm2-135m-instruct \\
        --out docs/bench/deploy.json --plot docs/bench/deploy.png
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from serve_bench import ROOT, chat_prompts, free_port, load, plot, server, summarize


def triton_request(url: str, model: str, max_tokens: int):
    """One streamed ``generate_stream`` request: text, tokens, time to first token, duration."""
    def send(prompt: str) -> dict:
        body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
        begin, first, pieces, tokens = time.perf_counter(), None, [], 0
        request = urllib.request.Request(f"{url}/v2/models/{model}/generate_stream", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            for line in reply:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                if event["text_output"]:
                    first = first or time.perf_counter()
                    pieces.append(event["text_output"])
                tokens = event["completion_tokens"]
        end = time.perf_counter()
        return {"text": "".join(pieces), "tokens": tokens, "ttft": (first or end) - begin,
                "seconds": end - begin}

    return send


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--prompts-file", type=Path, default=ROOT / "data" / "prompts" / "gsm8k.jsonl")
    p.add_argument("--skip", type=int, default=180, help="held-out records from here [180]")
    p.add_argument("--limit", type=int, default=8, help="requests per run [8]")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="runtime.serve's and Triton's [2]")
    p.add_argument("--replica-threads", type=int, default=1, help="each Ray replica's [1]")
    p.add_argument("--draft-schedule", default=None, help="every server's [each measures its own]")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("deploy_bench.json"))
    p.add_argument("--plot", type=Path, default=Path("deploy_bench.png"))
    args = p.parse_args()

    import ray
    from ray import serve

    from runtime import Generator
    from runtime.serving.ray_serve import application, local_cluster
    from runtime.serving.tritonserver_repo import write_model

    generator = Generator.from_engine(args.engine, threads=args.threads)
    prompts, clients = chat_prompts(generator, args), [int(n) for n in args.clients.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="deploy_bench_"))
    print(f"server logs: {logs}", flush=True)
    schedule = ["--draft-schedule", args.draft_schedule] if args.draft_schedule else []
    write_model(args.engine, logs / "models", "m", threads=args.threads, draft_schedule=args.draft_schedule)
    runs: dict = {}
    requests = {}
    with ExitStack() as stack:
        port = free_port()
        url, _ = stack.enter_context(server("runtime.serve", [
            sys.executable, "-m", "runtime.serve", "--engine", str(args.engine),
            "--threads", str(args.threads), "--model", "m", "--max-queue", "1024", "--port", str(port),
            *schedule], "/health", port, logs / "serve.log"))
        requests["runtime.serve"] = (url, None)
        http, grpc, metrics = free_port(), free_port(), free_port()
        url, _ = stack.enter_context(server("triton", [
            "bash", "scripts/tritonserver.sh", "--model-repository", str(logs / "models"),
            "--http-address", "127.0.0.1", "--http-port", str(http), "--grpc-address", "127.0.0.1",
            "--grpc-port", str(grpc), "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics),
            "--allow-gpu-metrics", "false", "--pinned-memory-pool-byte-size", "0"], "/v2/models/m/ready",
            http, logs / "triton.log"))
        requests["triton"] = (url, triton_request(url, "m", args.max_tokens))
        ray.init(log_to_driver=False, **local_cluster(3 * args.replica_threads))   # 1 + 2 replicas
        stack.callback(ray.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)
        for replicas in (1, 2):
            name = f"ray, {replicas} replica{'s' if replicas > 1 else ''}"
            serve.run(application(str(args.engine), replicas, threads=args.replica_threads, max_queue=1024,
                                  draft_schedule=args.draft_schedule, model="m"),
                      name=f"r{replicas}", route_prefix=f"/r{replicas}")
            requests[name] = (f"http://127.0.0.1:{port}/r{replicas}", None)
        names = list(requests)
        runs = {name: {n: [] for n in clients} for name in names}
        for repeat in range(args.repeat):
            for n in clients:
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    url, request = requests[name]
                    run = load(url, "m", prompts, n, args.max_tokens, request)
                    runs[name][n].append(run)
                    print(f"pass {repeat + 1} {name:16s} N={n}: {run['total_tok_s']:6.1f} tok/s total, "
                          f"TTFT p50 {run['ttft_p50']:.2f} s p95 {run['ttft_p95']:.2f} s", flush=True)
                reference = runs["runtime.serve"][n][-1]["texts"]
                for name in names:
                    runs[name][n][-1]["exact"] = runs[name][n][-1]["texts"] == reference
    runs["generate"] = [0.0]   # no in-process baseline here (serve_bench.py has it)
    report = summarize(runs, clients, args)
    for name in names:
        for n in clients:
            report["table"][name][n]["exact"] = all(r["exact"] for r in runs[name][n])
    report.update(threads=args.threads, replica_threads=args.replica_threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, clients, args.plot)
    print(json.dumps(report["table"], indent=1))


if __name__ == "__main__":
    main()
