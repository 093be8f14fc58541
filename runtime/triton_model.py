"""A Triton Inference Server Python-backend model over an engine directory: the ``TritonPythonModel``
that ``python -m export triton-repo`` writes a model repository for (``export/triton_repo.py``).

The model is decoupled and speaks Triton's generate extension: ``POST /v2/models/NAME/generate``
(one response: the whole text) and ``generate_stream`` (with ``"stream": true``, one response per
step with the text that step accepted, then one with the finish reason; over SSE). Each instance
runs one backend under the scheduler thread the OpenAI server uses (``request_loop.Engine``), so
requests join and leave its batch as they come, with the same per-request options and checks.

Inputs (``export.triton_repo.INPUTS``): ``text_input`` and, all optional, ``max_tokens``,
``temperature``, ``top_p``, ``random_seed``, ``stop_words``, ``stream`` and ``speculative``;
outputs: ``text_output``, ``finish_reason`` (empty until the last response) and
``completion_tokens``.
"""
from __future__ import annotations

import json

import numpy as np

from export.triton_repo import INPUTS

from .request_loop import Engine, Job, RequestError, request_params
from .text_stream import TextStream


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        from .draft_schedule import DraftSchedule
        from .generator import Generator

        self.pb = pb_utils
        parameters = {key: value["string_value"]
                      for key, value in json.loads(args["model_config"])["parameters"].items()}
        threads = int(parameters["threads"]) if parameters.get("threads") else None
        self.generator = Generator.from_engine(parameters["engine"], parameters.get("backend", "ort"),
                                               threads)
        backend = self.generator.backend
        schedule = parameters.get("draft_schedule")
        schedule = DraftSchedule.parse(schedule, backend.limits.k) if schedule else None
        self.engine = Engine(backend, int(parameters.get("max_queue", 64)), schedule)

    def execute(self, requests) -> None:
        for request in requests:
            self._start(request)
        return None   # decoupled: the responses go through each request's sender

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        try:
            body = self._body(request)
            prompt = body.pop("prompt", None)
            if not isinstance(prompt, str) or not prompt:
                raise RequestError(400, "'text_input': expected a non-empty string", "text_input")
            ids = self.generator.encode(prompt, chat_template=False)
            params = request_params(body, ids, self.generator)
            stream, text = bool(body.get("stream", False)), TextStream(self.generator.decode, params.stop)
            job = Job(ids, params, lambda event: self._deliver(request, sender, job, stream, text, event))
            self.engine.submit(job)
        except RequestError as err:
            self._refuse(sender, err)

    def _body(self, request) -> dict:
        """The request's inputs under their OpenAI names, a one-element tensor as its element;
        a wrong type or shape is one line naming the input."""
        body = {}
        for name, _, _, field in INPUTS:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            values = tensor.as_numpy().reshape(-1).tolist()
            values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
            if field != "stop" and len(values) != 1:
                raise RequestError(400, f"'{name}': {len(values)} values; expected one", name)
            body[field] = values if field == "stop" else values[0]
        return body

    def _deliver(self, request, sender, job: Job, stream: bool, text: TextStream, event) -> None:
        """A step's event for ``job`` (on the scheduler thread): a streamed request's new text, or
        at its end the rest and its finish reason. A request Triton cancelled (its client went
        away) is cancelled here, at the next step."""
        pb = self.pb
        if isinstance(event, RequestError):
            self._refuse(sender, event)
            return
        if event is not None and request.is_cancelled():
            self.engine.cancel(job)
            return
        ids = event if event is not None else job.request.token_ids
        if event is not None:
            piece = text.piece(ids) if stream else ""
            if piece:
                sender.send(self._response(piece, "", len(ids)))
            return
        final = text.piece(ids, final=True) if stream else text.text(ids)
        reason = job.request.finish_reason
        sender.send(self._response(final, reason, len(ids)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, text: str, reason: str, tokens: int):
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)),
            pb.Tensor("completion_tokens", np.array([tokens], dtype=np.int32))])

    def _refuse(self, sender, err: RequestError) -> None:
        pb = self.pb
        code = {429: "UNAVAILABLE", 503: "UNAVAILABLE", 500: "INTERNAL"}.get(err.status, "INVALID_ARG")
        sender.send(pb.InferenceResponse(error=pb.TritonError(err.message, getattr(pb.TritonError, code))),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self.engine = self.generator = None
