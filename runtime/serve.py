"""``python -m runtime.serve --engine DIR``: an OpenAI-compatible server over one engine directory.

HTTP handlers (FastAPI on uvicorn) hand requests to the scheduler thread (``request_loop.Engine``)
and receive each step's tokens in an asyncio queue of their own, so requests join and leave the
running batch as they come (``runtime/scheduler.py``). Bad requests get an OpenAI-style error
object with the right status; a full queue gets 429 with ``Retry-After``; a client that goes away
cancels its request at the next step.
"""
# no ``from __future__ import annotations``: FastAPI reads the handlers' parameter types at run time
import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from .backends import BACKENDS
from .draft_schedule import DraftSchedule
from .generator import Generator
from .params import Params
from .request_loop import Engine, Job, RequestError, body_field, request_params
from .text_stream import TextStream


class Server:
    """The FastAPI application over one engine. ``start_loading`` opens the engine on a thread of
    its own (``load`` gives the ``Generator``) and measures the draft schedule unless one is
    given; until it is done ``/health`` and requests answer 503 with ``Retry-After``, as
    llama-server's do while its model loads."""

    def __init__(self, load: Callable[[], Generator], model: str, max_queue: int,
                 draft_schedule: DraftSchedule | None = None):
        self.load, self.model, self.max_queue, self.draft_schedule = load, model, max_queue, draft_schedule
        self.generator: Generator | None = None
        self.engine: Engine | None = None
        self.created = int(time.time())

    def start_loading(self, failed: Callable[[str], None]) -> threading.Thread:
        """Load in the background; ``failed`` gets one line if that goes wrong."""
        def run():
            try:
                self.open()
            except Exception as err:   # a damaged engine is a ValueError; any other is named too
                failed(f"error: {err}" if isinstance(err, ValueError) else
                       f"error: loading the engine failed: {type(err).__name__}: {err}")

        thread = threading.Thread(target=run, name="loading", daemon=True)
        thread.start()
        return thread

    def open(self) -> None:
        generator = self.load()
        self.engine = Engine(generator.backend, self.max_queue, self.draft_schedule)
        self.generator = generator      # last: from here on the server is ready

    def ready(self) -> Engine:
        if self.generator is None:
            raise RequestError(503, "the model is loading; retry shortly", kind="unavailable_error")
        return self.engine

    def params(self, body: dict, prompt: list[int]) -> Params:
        if body.get("model") not in (None, self.model):
            raise RequestError(404, f"model {body['model']!r} does not exist; this server serves "
                                    f"{self.model!r}", "model", kind="not_found_error")
        if body_field(body, "n", int, 1) != 1:
            raise RequestError(400, "'n': only 1 is supported", "n")
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body_field(body, "max_completion_tokens", int, None,
                                                     lambda v: v >= 1, "an integer of at least 1")}
        return request_params(body, prompt, self.generator)

    def prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)):
                raise RequestError(400, "'messages': expected a non-empty list of {\"role\", \"content\"} "
                                        "objects with string content", "messages")
            from export.prompts import encode_conversation
            try:
                return encode_conversation(self.generator.tokenizer, messages)
            except ValueError as err:
                raise RequestError(400, str(err), "messages") from None
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "'prompt': expected a non-empty string", "prompt")
        return self.generator.encode(prompt, chat_template=False)

    def app(self):
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        app = FastAPI(title="dspark-trt")

        @app.exception_handler(RequestError)
        async def refused(_, err: RequestError):
            headers = {"Retry-After": "1"} if err.status in (429, 503) else None
            return JSONResponse(err.body(), status_code=err.status, headers=headers)

        @app.get("/health")
        async def health():
            self.ready()
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(self.ready().metrics.text(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model",
                                                "created": self.created, "owned_by": "dspark-trt"}]}

        async def complete(http: HttpRequest, chat: bool):
            try:
                body = json.loads(await http.body())
            except ValueError:
                raise RequestError(400, "the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            engine = self.ready()
            prompt = self.prompt(body, chat)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()
            job = Job(prompt, self.params(body, prompt),
                      lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            engine.submit(job)
            stream = body_field(body, "stream", bool, False)
            usage = stream and bool((body_field(body, "stream_options", dict, {}) or {}).get("include_usage"))
            if stream:
                first = await events.get()   # a refusal is still an HTTP error, not a stream
                if isinstance(first, RequestError):
                    raise first
                return StreamingResponse(self.sse(http, job, events, chat, first, usage),
                                         media_type="text/event-stream")
            return JSONResponse(await self.whole(http, job, events, chat))

        @app.post("/v1/completions")
        async def completions(http: HttpRequest):
            return await complete(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HttpRequest):
            return await complete(http, chat=True)

        return app

    def _reply(self, chat: bool, choice: dict, **extra) -> dict:
        return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                "object": ("chat.completion" if chat else "text_completion") + extra.pop("suffix", ""),
                "created": int(time.time()), "model": self.model, "choices": [choice], **extra}

    @staticmethod
    def _usage(job: Job) -> dict:
        done = len(job.request.token_ids)
        return {"prompt_tokens": len(job.prompt), "completion_tokens": done,
                "total_tokens": len(job.prompt) + done}

    @staticmethod
    def _speculative(job: Job) -> dict:
        """The response's extra field: its speculation statistics (no verify steps without
        speculation: its steps decoded one token each)."""
        stats = job.request.stats
        return {"tau": stats.tau, "accepted_per_position": stats.acceptance_per_position,
                "verify_steps": stats.steps if stats.k else 0}

    async def whole(self, http, job: Job, events: asyncio.Queue, chat: bool) -> dict:
        """The reply once the request has ended; a client that goes away before is cancelled at the
        next step, as a streamed one is."""
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, job))
        ids = []
        try:
            while (event := await events.get()) is not None:
                if isinstance(event, RequestError):
                    raise event
                ids = event
        finally:
            watcher.cancel()
        text = TextStream(self.generator.decode, job.params.stop).text(ids)
        reason = job.request.finish_reason
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return self._reply(chat, choice, usage=self._usage(job), speculative=self._speculative(job))

    async def _cancel_on_disconnect(self, http, job: Job) -> None:
        """Once the body is read, a request's receive channel has one more message: the client's
        disconnect."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self.engine.cancel(job)

    async def sse(self, http, job: Job, events: asyncio.Queue, chat: bool, first, usage: bool):
        """The server-sent events of a streamed reply, from the job's ``events``."""
        stream = TextStream(self.generator.decode, job.params.stop)

        suffix = ".chunk" if chat else ""

        def chunk(delta: dict, reason: str | None = None, **extra) -> str:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": reason,
                          "logprobs": None}
            return f"data: {json.dumps(self._reply(chat, choice, suffix=suffix, **extra))}\n\n"

        if chat:
            yield chunk({"role": "assistant", "content": ""})
        event, ids = first, []
        try:
            while event is not None:
                if isinstance(event, RequestError):   # the engine failed mid-stream
                    yield f"data: {json.dumps(event.body())}\n\n"
                    return
                ids = event
                if await http.is_disconnected():
                    self.engine.cancel(job)
                    return
                piece = stream.piece(ids)
                if piece:
                    yield chunk({"content": piece})
                event = await events.get()
            rest = stream.piece(ids, final=True)
            if rest:
                yield chunk({"content": rest})
            yield chunk({}, job.request.finish_reason, speculative=self._speculative(job))
            if usage:
                reply = self._reply(chat, {}, suffix=suffix, usage=self._usage(job))
                reply["choices"] = []
                yield f"data: {json.dumps(reply)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not (job.request and job.request.finished):
                self.engine.cancel(job)


def main(argv: list[str] | None = None) -> None:
    from export.cli_parser import Parser

    p = Parser(prog="python -m runtime.serve",
               description="Serve an engine directory over an OpenAI-compatible HTTP API "
                           "(/v1/chat/completions, /v1/completions, /v1/models, /health).")
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--backend", default="ort", choices=BACKENDS,
                   help="ort: ONNX Runtime on the CPU; torch: the PyTorch reference; torch-cuda, trt, "
                        "trt-rtx: on a CUDA GPU with CUDA graphs, every step on the whole pool of "
                        "slots [ort]")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads [all cores]")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="the model name clients use [the engine directory's name]")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more get 429 [64]")
    p.add_argument("--draft-schedule", metavar="BUSY:DRAFTS,...",
                   help="drafts verified per step as requests fill the slots, e.g. 1:7,4:3,8:0 "
                        "(from 1 busy slot 7, from 4 on 3, from 8 on none), or one number "
                        "[measured at start on this machine]")
    args = p.parse_args(argv)
    from export import manifest as manifest_file

    try:   # what can be checked before listening gets one line and status 1 now
        manifest = manifest_file.read(Path(args.engine))
        schedule = (DraftSchedule.parse(args.draft_schedule, manifest["draft"]["k"]) if args.draft_schedule
                    else None)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    import uvicorn

    server = Server(lambda: Generator.from_engine(args.engine, args.backend, args.threads),
                    args.model or Path(args.engine).resolve().name, args.max_queue, schedule)
    # SIGINT / SIGTERM: stop accepting, let running requests finish for up to 10 s, exit 0
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=10)
    http = _clean_exit_class()(config)
    failures = []

    def failed(message: str) -> None:
        failures.append(message)
        print(message, file=sys.stderr, flush=True)
        http.should_exit = True

    server.start_loading(failed)
    http.run()
    if failures:
        raise SystemExit(1)


def _clean_exit_class():
    import uvicorn

    class CleanExit(uvicorn.Server):
        """uvicorn's server, except that a stop asked for by SIGINT / SIGTERM ends with status 0
        (uvicorn raises the signal again once it has shut down)."""

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
