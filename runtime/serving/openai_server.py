"""The OpenAI-compatible HTTP application over one engine directory (FastAPI).

HTTP handlers hand requests to the scheduler thread (``request_loop.RequestLoop``) and receive each
step's tokens in an asyncio queue of their own, so requests join and leave the running batch as
they come (``runtime/decoding/scheduler.py``). Bad requests get an OpenAI-style error object with
the right status; a full queue gets 429 with ``Retry-After``; a client that goes away cancels its
request at the next step. ``python -m runtime.serve`` and Ray Serve replicas run it.
"""
# no ``from __future__ import annotations``: FastAPI reads the handlers' parameter types at run time
import asyncio
import functools
import json
import threading
import time
from typing import Callable

from runtime.decoding.draft_schedule import DraftSchedule
from runtime.decoding.generator import Generator
from runtime.serving.openai_reply import ABORTED, Reply
from runtime.serving.openai_request import (
    body_field,
    chat_prompt,
    completion_prompts,
    refuse_what_is_not_served,
    request_params,
)
from runtime.serving.request_error import RequestError
from runtime.serving.request_loop import RequestLoop


class Server:
    """The FastAPI application over one engine. ``start_loading`` opens the engine on a thread of
    its own (``load`` gives the ``Generator``) and measures the draft schedule unless one is
    given; until it is done ``/health`` and requests answer 503 with ``Retry-After``, as
    llama-server's do while its model loads. A request body over ``max_body`` bytes gets 413; a
    body is parsed and its prompts tokenized on a worker thread, so that a huge one delays no
    other request."""

    def __init__(self, load: Callable[[], Generator], model: str, max_queue: int,
                 draft_schedule: DraftSchedule | None = None, max_body: int = 16 << 20):
        self.load, self.model, self.max_queue, self.draft_schedule = load, model, max_queue, draft_schedule
        self.max_body = max_body
        self.generator: Generator | None = None
        self.request_loop: RequestLoop | None = None
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
        self.request_loop = RequestLoop(generator.backend, self.max_queue, self.draft_schedule)
        self.token_text = functools.lru_cache(maxsize=None)(
            lambda id_: generator.tokenizer.decode([id_]))
        self.generator = generator      # last: from here on the server is ready

    def stop(self) -> None:
        """End the requests still running with 503 (``RequestLoop.stop``)."""
        if self.request_loop is not None:
            self.request_loop.stop()

    def close(self) -> None:
        """Stop, and wait until the scheduler thread has ended."""
        self.stop()
        if self.request_loop is not None:
            self.request_loop.join()

    def ready(self) -> RequestLoop:
        if self.generator is None:
            raise RequestError(503, "the model is loading; retry shortly", kind="unavailable_error")
        return self.request_loop

    def reply(self, raw: bytes, chat: bool,
              send: Callable[[int], Callable[[object], None]]) -> tuple[Reply, bool, bool]:
        """A request body read into its ``Reply`` (jobs not submitted yet), whether it streams and
        whether its stream ends with a usage chunk: the JSON, the prompts' tokens and the options,
        each refused in one line. Runs on a worker thread."""
        try:
            body = json.loads(raw)
        except ValueError:
            raise RequestError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        refuse_what_is_not_served(body)
        if body.get("model") not in (None, self.model):
            raise RequestError(404, f"model {body['model']!r} does not exist; this server serves "
                                    f"{self.model!r}", "model", kind="not_found_error")
        generator = self.generator
        prompts = [chat_prompt(body, generator)] if chat else completion_prompts(body, generator)
        params = [request_params(body, prompt, generator, chat, generator.sampling_defaults)
                  for prompt in prompts]
        choices = self.max_queue + generator.backend.limits.max_batch
        n = body_field(body, "n", int, 1, lambda v: 1 <= v * len(prompts) <= choices,
                       f"at least 1, at most {choices} choices in all (the slots and --max-queue)")
        echo = not chat and body_field(body, "echo", bool, False)
        stream = body_field(body, "stream", bool, False)
        usage = stream and bool((body_field(body, "stream_options", dict, {}) or {}).get("include_usage"))
        reply = Reply(self.model, chat, prompts, params, n, echo, generator.decode, self.token_text, send)
        return reply, stream, usage

    def app(self):
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="dspark-trt")

        @app.exception_handler(RequestError)
        async def refused(_, err: RequestError):
            headers = {"Retry-After": "1"} if err.status in (429, 503) else None
            return JSONResponse(err.body(), status_code=err.status, headers=headers)

        @app.exception_handler(HTTPException)
        async def http_error(http, err: HTTPException):
            """Starlette's own refusals (no such route, a method the route has not) as OpenAI's."""
            path = http.url.path
            message = {404: f"no route {path}",
                       405: f"{http.method} is not allowed on {path}"}.get(err.status_code, err.detail)
            kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
            return await refused(http, RequestError(err.status_code, message, kind=kind))

        @app.exception_handler(RequestValidationError)
        async def invalid(http, err: RequestValidationError):
            first = err.errors()[0] if err.errors() else {}
            where = ".".join(map(str, first.get("loc", ())))
            return await refused(http, RequestError(422, f"'{where}': {first.get('msg', 'invalid')}", where))

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
            raw = await self._body(http)
            engine = self.ready()
            loop, events = asyncio.get_running_loop(), asyncio.Queue()

            def send(index: int):
                return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, event))

            reply, stream, usage = await asyncio.to_thread(self.reply, raw, chat, send)
            submitted = []
            try:
                for job in reply.jobs:
                    engine.submit(job)
                    submitted.append(job)
            except RequestError:
                for job in submitted:
                    engine.cancel(job)
                raise
            if stream:
                first = await events.get()   # a refusal is still an HTTP error, not a stream
                if isinstance(first[1], RequestError):
                    self._cancel(reply)
                    raise first[1]
                return StreamingResponse(self.sse(http, reply, events, first, usage),
                                         media_type="text/event-stream")
            return JSONResponse(await self.whole(http, reply, events))

        @app.post("/v1/completions")
        async def completions(http: HttpRequest):
            return await complete(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: HttpRequest):
            return await complete(http, chat=True)

        return app

    async def _body(self, http) -> bytes:
        """The request's body, refused with 413 once it is over ``max_body`` bytes (at once when its
        ``Content-Length`` says so)."""
        limit = self.max_body
        too_large = RequestError(413, f"the request body is over {limit} bytes (--max-body)",
                                 kind="invalid_request_error")
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _cancel(self, reply: Reply) -> None:
        for job in reply.jobs:
            if not (job.request and job.request.finished):
                self.request_loop.cancel(job)

    async def whole(self, http, reply: Reply, events: asyncio.Queue) -> dict:
        """The reply once every choice has ended; a client that goes away before is cancelled at
        the next step, as a streamed one is."""
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, reply))
        pending = len(reply.choices)
        try:
            while pending:
                _, event = await events.get()
                if isinstance(event, RequestError):
                    raise event
                pending -= event is None
        finally:
            watcher.cancel()
            self._cancel(reply)
        return reply.whole()

    async def _cancel_on_disconnect(self, http, reply: Reply) -> None:
        """Once the body is read, a request's receive channel has one more message: the client's
        disconnect."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self._cancel(reply)

    async def sse(self, http, reply: Reply, events: asyncio.Queue, first, usage: bool):
        """The server-sent events of a streamed reply, from its choices' ``events``. A stop of the
        server (or a failure of the engine) ends each open choice with finish reason ``abort``,
        then an error event and ``[DONE]``."""
        def data(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        for chunk in reply.opening():
            yield data(chunk)
        (index, event), pending = first, len(reply.choices)
        try:
            while True:
                choice = reply.choices[index]
                if isinstance(event, RequestError):
                    for open_choice in reply.choices:
                        if not open_choice.ended:
                            for chunk in reply.closing(open_choice, ABORTED):
                                yield data(chunk)
                    yield data(event.body())
                    break
                if event is None:
                    for chunk in reply.closing(choice):
                        yield data(chunk)
                    pending -= 1
                    if not pending:
                        if usage:
                            yield data(reply.usage_chunk())
                        break
                elif (chunk := reply.step(choice, event)) is not None:
                    yield data(chunk)
                if await http.is_disconnected():
                    return
                index, event = await events.get()
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(reply)
