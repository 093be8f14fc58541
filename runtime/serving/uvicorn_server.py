"""``python -m runtime.serve --engine DIR``: an OpenAI-compatible server over one engine directory
(``runtime/serving/openai_server.py``) on uvicorn, which says where it listens once it does and,
on SIGINT / SIGTERM, lets running requests finish within a grace period.
"""
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from runtime.decoding.draft_schedule import LoadSchedule
from runtime.decoding.generator import Generator
from runtime.serving.openai_server import Server
from runtime.serving.server_flags import add_server_flags, check_finite, check_port, model_name, stopping_line


def main(argv: list[str] | None = None) -> None:
    from common.cli_parser import Parser

    p = Parser(prog="python -m runtime.serve",
               description="Serve an engine directory over an OpenAI-compatible HTTP API "
                           "(/v1/chat/completions, /v1/completions, /v1/models, /health).")
    add_server_flags(
        p, backend="ort: ONNX Runtime on the CPU; torch: the PyTorch reference; torch-cuda, trt, "
                   "trt-rtx: on a CUDA GPU with CUDA graphs, every step on the whole pool of slots [ort]",
        threads="ONNX Runtime intra-op threads [all cores]",
        max_queue="requests that may wait for a slot; more get 429 [64]",
        draft_schedule="drafts verified per step: adaptive (by the requests' own acceptance and the "
                       "call costs measured at start on this machine), or fixed as requests fill the "
                       "slots, e.g. 1:7,4:3,8:0 (from 1 busy slot 7, from 4 on 3, from 8 on none), or "
                       "one number [adaptive]")
    p.add_argument("--max-body", type=float, default=16, metavar="MB",
                   help="the largest request body accepted, in MB; larger ones get 413 [16]")
    p.add_argument("--access-log", action="store_true", help="log every request on stderr (uvicorn's)")
    args = p.parse_args(argv)
    from common import manifest as manifest_file

    try:   # what can be checked before listening gets one line and status 1 now
        check_port("--port", args.port)
        check_finite("--max-body", args.max_body)
        check_finite("--grace-period", args.grace_period)
        k = manifest_file.read(Path(args.engine))["draft"]["k"]
        schedule = LoadSchedule.parse(args.draft_schedule, k) if args.draft_schedule else None
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    import logging

    import uvicorn

    model = model_name(args)
    server = Server(lambda: Generator.from_engine(args.engine, args.backend, args.threads), model,
                    args.max_queue, schedule, int(args.max_body * (1 << 20)))
    # uvicorn's own deadline comes after ours (``CleanExit.shutdown``): requests end with 503 first
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level="warning",
                            access_log=args.access_log, timeout_graceful_shutdown=args.grace_period + 10)
    if args.access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    http = _clean_exit_class()(config, server, args.grace_period,
                               f"serving {args.engine} as model {model!r} on http://{args.host}:{args.port}")
    failures = []

    def failed(message: str) -> None:
        failures.append(message)
        print(message, file=sys.stderr, flush=True)
        http.should_exit = True

    server.start_loading(failed)
    try:
        http.run()
    finally:
        server.close()
    if failures:
        raise SystemExit(1)


def _clean_exit_class():
    import uvicorn

    class CleanExit(uvicorn.Server):
        """uvicorn's server, except that it says where it listens once it does, and that a stop
        asked for by SIGINT / SIGTERM lets running requests go on for ``grace`` seconds, then ends
        those left with 503 (a stream: its last chunk, an error event and ``[DONE]``), so that
        every client sees a well-formed end, and exits with status 0 (uvicorn raises the signal
        again once it has shut down)."""

        def __init__(self, config, server: Server, grace: float, listening: str):
            super().__init__(config)
            self.server, self.grace, self.listening = server, grace, listening

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(self.listening, file=sys.stderr, flush=True)

        async def shutdown(self, sockets=None):
            print(stopping_line(self.grace), file=sys.stderr, flush=True)
            deadline = asyncio.get_running_loop().call_later(self.grace, self.server.stop)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            signals = (signal.SIGINT, signal.SIGTERM)
            before = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    return CleanExit


if __name__ == "__main__":
    main()
