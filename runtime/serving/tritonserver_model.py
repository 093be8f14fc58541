"""A Triton Inference Server Python-backend model over an engine directory: the ``TritonPythonModel``
that ``python -m export triton-repo`` writes a model repository for (``runtime/serving/tritonserver_repo``).

The model is decoupled and speaks Triton's generate extension (``runtime/serving/tritonserver_io.py``):
``POST /v2/models/NAME/generate`` (one response: the whole text) and ``generate_stream`` (with
``"stream": true``, one response per step with the text that step accepted, then one with the
finish reason; over SSE). Each instance runs one backend under the scheduler thread the OpenAI
server uses (``request_loop.RequestLoop``), so requests join and leave its batch as they come, with the
same per-request options and checks.
"""
from __future__ import annotations

import json

from runtime.serving import tritonserver_io
from runtime.serving.request_error import RequestError
from runtime.serving.request_loop import Job, RequestLoop
from runtime.serving.tritonserver_metrics import TritonMetrics


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        from runtime.decoding.draft_schedule import LoadSchedule
        from runtime.decoding.generator import Generator

        self.pb = pb_utils
        parameters = {key: value["string_value"]
                      for key, value in json.loads(args["model_config"])["parameters"].items()}
        threads = int(parameters["threads"]) if parameters.get("threads") else None
        self.generator = Generator.from_engine(parameters["engine"], parameters.get("backend", "ort"),
                                               threads)
        backend = self.generator.backend
        schedule = parameters.get("draft_schedule")
        schedule = LoadSchedule.parse(schedule, backend.limits.k) if schedule else None
        self.request_loop = RequestLoop(backend, int(parameters.get("max_queue", 64)), schedule)
        self.metrics = TritonMetrics(pb_utils, self.request_loop.metrics.registry,
                                     {"model": args["model_name"], "version": args["model_version"],
                                      "instance": args["model_instance_name"]})

    def execute(self, requests) -> None:
        for request in requests:
            self._start(request)
        return None   # decoupled: the responses go through each request's sender

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        tensors = {name: tensor.as_numpy() for name, *_ in tritonserver_io.INPUTS
                   if (tensor := self.pb.get_input_tensor_by_name(request, name)) is not None}
        try:
            ids, params, stream = tritonserver_io.read(tensors, self.generator)
            replies = tritonserver_io.Replies(self.generator, params, stream)
            job = Job(ids, params, lambda event: self._deliver(request, sender, job, replies, event))
            self.request_loop.submit(job)
        except RequestError as err:
            self._refuse(sender, err)

    def _deliver(self, request, sender, job: Job, replies: tritonserver_io.Replies, event) -> None:
        """A step's event for ``job`` (on the scheduler thread): a streamed request's new text, or
        at its end the rest and its finish reason. A request Triton cancelled (its client went
        away) is cancelled here, at the next step."""
        if isinstance(event, RequestError):
            self._refuse(sender, event)
        elif event is not None and request.is_cancelled():
            self.request_loop.cancel(job)
        elif event is not None:
            if (outputs := replies.step(event)) is not None:
                sender.send(self._response(outputs))
        else:
            sender.send(self._response(replies.final(job.request)),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, outputs: dict):
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(name, value)
                                                         for name, value in outputs.items()])

    def _refuse(self, sender, err: RequestError) -> None:
        pb = self.pb
        code = {429: "UNAVAILABLE", 503: "UNAVAILABLE", 500: "INTERNAL"}.get(err.status, "INVALID_ARG")
        sender.send(pb.InferenceResponse(error=pb.TritonError(err.message, getattr(pb.TritonError, code))),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        """Requests still running end with UNAVAILABLE, and the scheduler thread ends before the
        backend goes (``RequestLoop.stop``). Triton unloads a model once its requests are done, or at
        its exit timeout, when it exits without calling this: those requests break off there."""
        self.request_loop.stop()
        self.request_loop.join(10)
        self.metrics.close()
        self.metrics = self.request_loop = self.generator = None
