"""An engine directory served from Python through PyTriton (``nvidia-pytriton``): ``serve(engine)``
runs a Triton Inference Server of its own with the engine as a decoupled model; ``bind(triton,
engine)`` adds it to a ``pytriton.triton.Triton`` the caller runs beside other models.

The model speaks the generate extension like the model repository's (``runtime/serving/tritonserver_io.py``):
``/v2/models/NAME/generate``, ``generate_stream`` and gRPC streaming; its requests go to the
scheduler thread every front end shares (``request_loop.RequestLoop``), which runs in this process, with
the same per-request options and checks: a refused request gets Triton's error with one line
naming the input. The environment needs NumPy 1 (PyTriton's pin): ``.venv-triton``
(``scripts/setup_triton.sh``) is one.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sysconfig
import threading
from pathlib import Path

import numpy as np

from runtime.serving import tritonserver_io
from runtime.serving.request_error import RequestError
from runtime.serving.request_loop import Job, RequestLoop

# how often ``serve`` checks that Triton and its model are alive (PyTriton's own period)
ALIVE_CHECK_SECONDS = 5
DTYPES = {"TYPE_STRING": np.bytes_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32,
          "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}


class Refused(Exception):
    """A refused request, as PyTriton sends it: one line. PyTriton sends an exception as
    ``traceback.format_exception`` of it, so this one shows no traceback."""

    @property
    def __traceback__(self):
        return None

    @__traceback__.setter
    def __traceback__(self, _):
        pass


def bind(triton, engine: str | Path, name: str | None = None, backend: str = "ort",
         threads: int | None = None, max_queue: int = 64, draft_schedule: str | None = None) -> RequestLoop:
    """Add ``engine`` to ``triton`` as model ``name`` (default: the engine directory's name) on a
    ``backend`` (``threads`` CPU threads for ORT), with at most ``max_queue`` requests waiting for
    a slot; returns its scheduler thread. A ``Triton`` started before this must have had the
    interpreter's ``lib/`` first on ``LD_LIBRARY_PATH`` (``serve`` sees to that)."""
    from pytriton.model_config import ModelConfig, Tensor

    from runtime.decoding.draft_schedule import LoadSchedule
    from runtime.decoding.generator import Generator

    generator = Generator.from_engine(engine, backend, threads)
    schedule = LoadSchedule.parse(draft_schedule, generator.backend.limits.k) if draft_schedule else None
    request_loop = RequestLoop(generator.backend, max_queue, schedule)

    async def infer(requests):
        """One request's responses (a model without a batcher gets its requests one at a time),
        as its steps come from the scheduler thread; a request PyTriton closes is cancelled."""
        (request,) = requests
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            ids, params, stream = tritonserver_io.read(request.data, generator)
            job = Job(ids, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            request_loop.submit(job)
        except RequestError as err:
            raise Refused(err.message) from None
        replies = tritonserver_io.Replies(generator, params, stream)
        try:
            while (event := await events.get()) is not None:
                if isinstance(event, RequestError):
                    raise Refused(event.message)
                if (outputs := replies.step(event)) is not None:
                    yield [outputs]
            yield [replies.final(job.request)]
        except BaseException:
            request_loop.cancel(job)
            raise

    def tensors(entries, optional):
        return [Tensor(name=entry[0], dtype=DTYPES[entry[1]], shape=(entry[2],), optional=optional and i > 0)
                for i, entry in enumerate(entries)]

    triton.bind(model_name=name or Path(engine).resolve().name, infer_func=infer,
                inputs=tensors(tritonserver_io.INPUTS, True), outputs=tensors(tritonserver_io.OUTPUTS, False),
                config=ModelConfig(batching=False, decoupled=True))
    return request_loop


def serve(engine: str | Path, config=None, **options) -> None:
    """Serve ``engine`` (``bind``'s ``options``) from a ``Triton(config=config)`` of its own (a
    ``pytriton.triton.TritonConfig``: ports, addresses, logging) until SIGINT or SIGTERM, or until
    Triton dies. The signals set a flag this thread polls: ``Triton.serve`` relies on the
    KeyboardInterrupt reaching its wait, and a SIGINT that landed elsewhere was lost (the server
    kept serving)."""
    from pytriton.triton import Triton

    # Triton's Python-backend stub links libpython: this interpreter's, not another of the same
    # version (a pyenv build differs from the system's and kills the stub)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [sysconfig.get_config_var("LIBDIR"), os.environ.get("LD_LIBRARY_PATH")]))
    stopping = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    # where Python runs signal handlers; the caller's are back once this returns
    handled = threading.current_thread() is threading.main_thread()
    before = [signal.signal(number, lambda *_: stopping.set()) for number in signals] if handled else []
    try:
        with Triton(config=config) as triton:
            request_loop = bind(triton, engine, **options)
            try:
                triton.run()
                while not stopping.wait(ALIVE_CHECK_SECONDS) and triton.is_alive():
                    pass
            finally:   # requests still running end with UNAVAILABLE, the scheduler thread before the process
                request_loop.stop()
                request_loop.join()
    finally:
        for number, handler in zip(signals, before):
            signal.signal(number, handler)
