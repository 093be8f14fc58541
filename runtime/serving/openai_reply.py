"""One OpenAI-style reply: its choices (``n`` per prompt, in OpenAI's order: prompt by prompt), one
``id`` and ``created`` for the whole completion, every chunk of a stream included, and the
bodies: a whole ``chat.completion`` / ``text_completion``, or its stream's chunks. Token
log-probabilities come in OpenAI's two shapes: chat's ``{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}`` and completions' ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`` (with ``echo``, the prompt's first: its first token has none)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

from runtime.decoding.logprobs import TokenLogprob
from runtime.decoding.params import Params
from runtime.decoding.stats import SpecStats
from runtime.decoding.text_stream import TextStream
from runtime.serving.openai_request import Prompt
from runtime.serving.request_loop import Job

ABORTED = "abort"   # the finish reason of a choice the server stopped (vLLM's)


@dataclass(eq=False)
class Choice:
    index: int
    prompt: Prompt
    job: Job
    text: TextStream
    ids: list[int] = field(default_factory=list)    # its tokens so far
    scored: int = 0                                 # tokens whose log-probabilities were streamed
    offset: int = 0                                 # text streamed so far, in characters
    ended: bool = False


class Reply:
    """The choices of one request and their bodies; ``token_text`` is a token id's text."""

    def __init__(self, model: str, chat: bool, prompts: list[Prompt], params: list[Params], n: int,
                 echo: bool, decode: Callable[[list[int]], str], token_text: Callable[[int], str],
                 send: Callable[[int], Callable[[object], None]]):
        """``params[i]`` is prompt ``i``'s; choice ``j`` of a prompt draws from seed ``seed + j``.
        ``send(index)`` is the ``Job.send`` of choice ``index``."""
        self.model, self.chat, self.echo, self.token_text = model, chat, echo, token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompts = prompts
        self.choices = []
        for prompt, p in zip(prompts, params):
            for j in range(n):
                index = len(self.choices)
                seeded = replace(p, seed=p.seed + j)
                self.choices.append(Choice(index, prompt, Job(prompt.ids, seeded, send(index)),
                                           TextStream(decode, p.stop)))
        self.logprobs = params[0].logprobs is not None

    @property
    def jobs(self) -> list[Job]:
        return [c.job for c in self.choices]

    def _body(self, choices: list[dict], chunk: bool = False, **extra) -> dict:
        kind = "chat.completion" + (".chunk" if chunk else "") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def usage(self) -> dict:
        """OpenAI's usage, with the prompt tokens its slots' caches held already (``cached_tokens``)."""
        prompt = sum(len(p.ids) for p in self.prompts)
        done = sum(len(c.job.request.token_ids) for c in self.choices)
        cached = sum(c.job.request.reused for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def speculative(self, choices: list[Choice] | None = None) -> dict:
        """The reply's extra field: its speculation statistics (no verify steps without
        speculation: its steps decoded one token each). With no verify step, tau and the
        acceptance per position are null: nothing was measured."""
        requests = [c.job.request for c in choices or self.choices]
        stats = SpecStats(k=requests[0].stats.k)
        for request in requests:
            stats.merge(request.stats)
        steps = stats.steps if stats.k else 0
        return {"tau": stats.tau if steps else None,
                "accepted_per_position": stats.acceptance_per_position if steps else None,
                "verify_steps": steps}

    # the whole reply

    def whole(self) -> dict:
        choices = []
        for c in self.choices:
            request = c.job.request
            text = c.text.text(request.token_ids)
            choice = {"index": c.index, "finish_reason": request.finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = self._chat_logprobs(request.logprobs) if self.logprobs else None
            else:
                choice["text"] = (c.prompt.text if self.echo else "") + text
                entries = ([None, *request.prompt_logprobs] if self.echo else []) + request.logprobs
                choice["logprobs"] = self._completion_logprobs(c, entries, 0) if self.logprobs else None
            choices.append(choice)
        return self._body(choices, usage=self.usage(), speculative=self.speculative())

    # a stream's chunks

    def opening(self) -> list[dict]:
        """The chunks before any token: chat's role, or the echoed prompt of a completion."""
        if self.chat:
            return [self._chunk(c, {"role": "assistant", "content": ""}) for c in self.choices]
        return [self._chunk(c, c.prompt.text, logprobs=self._echoed(c)) for c in self.choices if self.echo]

    def step(self, choice: Choice, ids: list[int]) -> dict | None:
        """The chunk for a step that brought ``choice`` to ``ids``, if it has new text or new
        log-probabilities."""
        choice.ids = ids
        piece = choice.text.piece(ids)
        scored = self._new_logprobs(choice, len(ids)) if self.logprobs else None
        return self._chunk(choice, piece, logprobs=scored) if piece or scored else None

    def closing(self, choice: Choice, reason: str | None = None) -> list[dict]:
        """A choice's last chunks: what was held back, then its finish reason (the request's, or
        ``reason``) and its statistics."""
        choice.ended = True
        request = choice.job.request
        ids = request.token_ids if request is not None else choice.ids
        chunks = []
        rest = choice.text.piece(ids, final=True)
        scored = self._new_logprobs(choice, len(ids)) if self.logprobs and request is not None else None
        if rest or scored:
            chunks.append(self._chunk(choice, rest, logprobs=scored))
        finish = reason or request.finish_reason
        extra = {"speculative": self.speculative([choice])} if request is not None else {}
        chunks.append(self._chunk(choice, None, finish, **extra))
        return chunks

    def usage_chunk(self) -> dict:
        return self._body([], chunk=True, usage=self.usage())

    def _chunk(self, choice: Choice, text: str | dict | None, reason: str | None = None,
               logprobs=None, **extra) -> dict:
        """A chunk of ``choice``: ``text`` (chat: a delta object, or a string for its content)."""
        if self.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            body = {"index": choice.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            body = {"index": choice.index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return self._body([body], chunk=True, **extra)

    def _new_logprobs(self, choice: Choice, count: int):
        entries = choice.job.request.logprobs[choice.scored:count]
        if not entries:
            return None
        choice.scored += len(entries)
        return (self._chat_logprobs(entries) if self.chat
                else self._completion_logprobs(choice, entries, choice.offset))

    # log-probabilities in OpenAI's shapes

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def token(id_: int, logprob: float) -> dict:
            text = self.token_text(id_)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [token(e.token, e.logprob) | {"top_logprobs": [token(i, lp) for i, lp in e.top]}
                            for e in entries]}

    def _echoed(self, choice: Choice) -> dict | None:
        """The echoed prompt's log-probabilities, if asked."""
        if not self.logprobs:
            return None
        return self._completion_logprobs(choice, [None, *choice.job.request.prompt_logprobs], 0)

    def _completion_logprobs(self, choice: Choice, entries: list, offset: int) -> dict:
        """``entries`` (``TokenLogprob``s; None: the prompt's first token, which nothing predicts)
        with their texts' offsets from character ``offset`` on."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            text = self.token_text(choice.prompt.ids[0] if entry is None else entry.token)
            tokens.append(text)
            logprobs.append(None if entry is None else entry.logprob)
            tops.append(None if entry is None else {self.token_text(i): lp for i, lp in entry.top})
            offsets.append(offset)
            offset += len(text)
        choice.offset = offset
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
