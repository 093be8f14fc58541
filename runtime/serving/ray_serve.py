"""``python -m runtime.ray_serve --engine DIR --replicas N``: ``runtime.serve``'s OpenAI-compatible
routes on N Ray Serve replicas, each owning one backend (one GPU each on a GPU backend, else
``--threads`` CPUs).

Each replica serves at most ``max_batch`` requests at once (``max_ongoing_requests``: every one
has a slot), Ray's proxy queues up to ``--max-queue`` more for the replicas to take as slots
free, and answers 503 beyond that (Ray's backpressure, ``max_queued_requests``: per caller). A
replica that dies is replaced by Ray; the requests it was serving fail, the other replicas' go on.
Every response names the replica that served it (Ray's replica id and its process) in its
``x-replica`` header. SIGINT / SIGTERM stops as ``runtime.serve`` does, on every replica: running
requests go on for ``--grace-period`` seconds, those left then end with 503 (a stream: its last
chunk with finish reason ``abort``, an error event and ``[DONE]``), and only then does Ray Serve
shut down (the driver tells the replicas through a named actor, ``Stopping``).
``application(...)`` is the application, for ``serve.run`` or a ``serve run`` config.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from runtime.backends import GPU_BACKENDS
from runtime.serving.server_flags import add_server_flags, check_finite, check_port, stopping_line

# the named actor through which the driver stops the replicas, in a namespace of its own (a replica
# runs in Ray Serve's)
STOPPING, NAMESPACE = "stopping", "dspark-trt"


class Stopping:
    """The driver's stop, for every replica to see: the grace period once a stop is asked (None
    before), and the replicas that have ended their requests since."""

    def __init__(self):
        self.grace, self.ended = None, set()

    def stop(self, grace: float) -> None:
        self.grace = grace

    def asked(self) -> float | None:
        return self.grace

    def end(self, replica: str) -> None:
        self.ended.add(replica)

    def count(self) -> int:
        return len(self.ended)


async def _stop_when_asked(server, replica: str) -> None:
    """A replica's watch for the driver's stop: then running requests have the grace period, those
    left end with 503 and their replies are written before the replica says it has ended. Without
    the actor (an application deployed by other means) there is nothing to watch."""
    import ray

    try:
        stopping = ray.get_actor(STOPPING, namespace=NAMESPACE)
    except ValueError:
        return
    while (grace := await stopping.asked.remote()) is None:
        await asyncio.sleep(0.2)
    request_loop, deadline = server.request_loop, time.monotonic() + grace
    while (request_loop.jobs or request_loop.inbox.qsize()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    server.stop()
    deadline = time.monotonic() + 5
    while request_loop.thread.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)        # the handlers' last bytes through Ray's proxy
    await stopping.end.remote(replica)


def application(engine: str, replicas: int = 1, backend: str = "ort", threads: int | None = None,
                max_queue: int = 64, draft_schedule: str | None = None, model: str | None = None):
    """The Ray Serve application (``serve.run`` it); the engine is checked here, in one line."""
    from ray import serve

    from common import manifest as manifest_file
    from runtime.decoding.draft_schedule import LoadSchedule

    manifest = manifest_file.read(Path(engine))
    schedule = LoadSchedule.parse(draft_schedule, manifest["draft"]["k"]) if draft_schedule else None
    engine, model = str(Path(engine).resolve()), model or Path(engine).resolve().name

    def build():
        """The replica's app, made where it runs: its own backend, opened before it takes traffic."""
        from runtime.decoding.generator import Generator
        from runtime.serving.openai_server import Server

        server = Server(lambda: Generator.from_engine(engine, backend, threads), model, max_queue, schedule)
        server.open()
        app = server.app()
        replica = f"{serve.get_replica_context().replica_id.unique_id} (pid {os.getpid()})"
        # when Ray retires the replica: requests still running end with 503, the scheduler thread
        # before the process
        app.router.add_event_handler("shutdown", server.close)
        watch = []
        app.router.add_event_handler(
            "startup", lambda: watch.append(asyncio.get_running_loop().create_task(
                _stop_when_asked(server, replica))))

        @app.middleware("http")
        async def named(request, call_next):
            response = await call_next(request)
            response.headers["x-replica"] = replica
            return response

        return app

    gpu = backend in GPU_BACKENDS
    deployment = serve.deployment(
        serve.ingress(build)(), name="dspark", num_replicas=replicas,
        max_ongoing_requests=manifest["limits"]["max_batch"], max_queued_requests=max_queue,
        ray_actor_options={"num_gpus": 1 if gpu else 0, "num_cpus": 0 if gpu else threads or 1})
    return deployment.bind()


def local_cluster(cpus: int) -> dict:
    """``ray.init``'s options: a local cluster started here offers at least the CPUs the replicas
    reserve (else a replica beyond the cores would wait for one forever); a cluster that
    ``RAY_ADDRESS`` names keeps its own."""
    return {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(os.cpu_count() or 1, cpus)}


def main(argv: list[str] | None = None) -> None:
    from common.cli_parser import Parser

    p = Parser(prog="python -m runtime.ray_serve",
               description="Serve an engine directory's OpenAI-compatible routes on Ray Serve replicas "
                           "(a local Ray cluster unless RAY_ADDRESS names one).")
    add_server_flags(
        p, backend="ort / torch on CPUs; torch-cuda, trt, trt-rtx: one GPU per replica [ort]",
        threads="ONNX Runtime intra-op threads and CPUs per replica [1]",
        max_queue="requests Ray's proxy queues beyond the replicas' slots; more get 503 [64]",
        draft_schedule="drafts verified per step, as runtime.serve's [adaptive, its call costs measured "
                       "when each replica starts]")
    p.add_argument("--replicas", type=int, default=1, help="replicas, one backend each [1]")
    args = p.parse_args(argv)
    try:
        if args.replicas < 1:
            raise ValueError(f"--replicas {args.replicas}: expected at least 1")
        check_port("--port", args.port)
        check_finite("--grace-period", args.grace_period)
        app = application(args.engine, args.replicas, args.backend, args.threads, args.max_queue,
                          args.draft_schedule, args.model)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    import ray
    from ray import serve

    ray.init(log_to_driver=False, **local_cluster(args.replicas * (args.threads or 1)))
    stopping = ray.remote(num_cpus=0)(Stopping).options(name=STOPPING, namespace=NAMESPACE).remote()
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, route_prefix="/")
    print(f"serving {args.engine} on http://{args.host}:{args.port} ({args.replicas} replicas)", flush=True)
    # SIGINT / SIGTERM: every replica ends its requests (``_stop_when_asked``), then Ray Serve
    # shuts down and the cluster stops; exit 0
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    while not stop:
        signal.pause()
    print(stopping_line(args.grace_period), flush=True)
    stopping.stop.remote(args.grace_period)
    deadline = time.monotonic() + args.grace_period + 15
    while ray.get(stopping.count.remote()) < args.replicas and time.monotonic() < deadline:
        time.sleep(0.2)
    serve.shutdown()
    ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
