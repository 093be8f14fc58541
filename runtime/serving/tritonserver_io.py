"""Triton's generate extension as tensors, for both ways of running an engine in Triton Inference
Server: the model-repository model (``tritonserver_model.py``) and the PyTriton binding
(``pytriton_binding.py``). A request's input tensors are read as an OpenAI request's fields and
checked by the same rules as ``runtime.serve``'s; a request's events from the scheduler thread
become its responses' output tensors.

Inputs: ``text_input`` and, all optional, ``max_tokens``, ``temperature``, ``top_p``,
``random_seed``, ``stop_words``, ``stream`` and ``speculative``; outputs: ``text_output``,
``finish_reason`` (empty until the last response) and ``completion_tokens``.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from runtime.decoding.generator import Generator
from runtime.decoding.params import Params
from runtime.decoding.request import Request
from runtime.decoding.text_stream import TextStream
from runtime.serving.openai_request import Prompt, request_params
from runtime.serving.request_error import RequestError

# the generate extension's names (TensorRT-LLM's where it has them): (name, Triton data type,
# dims, and for an input the field of an OpenAI request it is)
INPUTS = [("text_input", "TYPE_STRING", 1, "prompt"), ("max_tokens", "TYPE_INT32", 1, "max_tokens"),
          ("temperature", "TYPE_FP32", 1, "temperature"), ("top_p", "TYPE_FP32", 1, "top_p"),
          ("random_seed", "TYPE_UINT64", 1, "seed"), ("stop_words", "TYPE_STRING", -1, "stop"),
          ("stream", "TYPE_BOOL", 1, "stream"), ("speculative", "TYPE_BOOL", 1, "speculative")]
OUTPUTS = [("text_output", "TYPE_STRING", 1), ("finish_reason", "TYPE_STRING", 1),
           ("completion_tokens", "TYPE_INT32", 1)]


def read(tensors: Mapping[str, np.ndarray], generator: Generator) -> tuple[list[int], Params, bool]:
    """A request's prompt ids, options and whether it streams, from its input tensors (a
    one-element tensor is its element); a wrong shape or value is one line naming the input."""
    body = {}
    for name, _, _, field in INPUTS:
        if name not in tensors:
            continue
        values = np.asarray(tensors[name]).reshape(-1).tolist()
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
        if field != "stop" and len(values) != 1:
            raise RequestError(400, f"'{name}': {len(values)} values; expected one", name)
        body[field] = values if field == "stop" else values[0]
    prompt = body.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'text_input': expected a non-empty string", "text_input")
    prompt = Prompt(generator.encode(prompt, chat_template=False), prompt, "text_input")
    params = request_params(body, prompt, generator, chat=False, defaults=generator.sampling_defaults)
    return prompt.ids, params, bool(body.get("stream", False))


class Replies:
    """One request's responses: with ``stream``, one per step with the text that step settled,
    then one with the rest and the finish reason; without, only that last one with the whole text."""

    def __init__(self, generator: Generator, params: Params, stream: bool):
        self.text, self.stream = TextStream(generator.decode, params.stop), stream

    def step(self, ids: list[int]) -> dict[str, np.ndarray] | None:
        """The response for a step that brought the request to ``ids``, if it has new text."""
        piece = self.text.piece(ids) if self.stream else ""
        return outputs(piece, "", len(ids)) if piece else None

    def final(self, request: Request) -> dict[str, np.ndarray]:
        ids = request.token_ids
        text = self.text.piece(ids, final=True) if self.stream else self.text.text(ids)
        return outputs(text, request.finish_reason, len(ids))


def outputs(text: str, finish_reason: str, tokens: int) -> dict[str, np.ndarray]:
    return {"text_output": np.array([text.encode()], dtype=np.object_),
            "finish_reason": np.array([finish_reason.encode()], dtype=np.object_),
            "completion_tokens": np.array([tokens], dtype=np.int32)}
