"""An OpenAI-style request read from its JSON body, field by field, as vLLM and llama-server read
it: the prompt (chat messages or completion prompts), the sampling options and what the reply
should carry. Every refusal is a ``RequestError``: the HTTP status, OpenAI's error type and one
line that names the request's own field (``param``), e.g. ``messages.[1].role`` or ``max_tokens``.
The OpenAI server, Ray Serve replicas and the Triton models all read requests here.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from runtime.backends.base import capacity_needed
from runtime.decoding.generator import Generator
from runtime.decoding.params import MAX_LOGPROBS, Params
from runtime.decoding.stop_strings import StopStrings
from runtime.serving.request_error import RequestError

# OpenAI's roles that a chat template reads; ``developer`` is OpenAI's newer name for ``system``
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def refuse_what_is_not_served(body: dict) -> None:
    """Refuse a request for tool calling, which this server has not (rather than answer as if the
    tools were not there), and a string holding a lone surrogate (JSON may escape one, ``\\ud800``,
    but no text is one: nothing encodes it), naming its field."""
    if body.get("tools") or body.get("functions"):
        name = "tools" if body.get("tools") else "functions"
        raise RequestError(400, f"'{name}': this server has no tool calling", name)

    def walk(value, where: str) -> None:
        if isinstance(value, str):
            lone = next((c for c in value if 0xD800 <= ord(c) <= 0xDFFF), None)
            if lone is not None:
                raise RequestError(400, f"'{where}': holds a lone surrogate ({ascii(lone)}), which is not "
                                        f"text; expected UTF-8 text", where)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}" if where else str(key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{where}.[{index}]")
    walk(body, "")


def body_field(body: dict, name: str, kind, default, check=None, expected: str = ""):
    """``body[name]`` of type ``kind`` (``default`` when absent or null), refused in one line."""
    value = body.get(name, default)
    if value is None:
        value = default
    kinds = (int, float) if kind is float else kind
    wrong = not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool)
    if value is not default and wrong:
        raise RequestError(400, f"'{name}': {value!r} is not {expected or kind.__name__}", name)
    if check is not None and value is not None and not check(value):
        raise RequestError(400, f"'{name}': {value!r}; expected {expected}", name)
    return value


@dataclass
class Prompt:
    """One prompt of a request: its token ids, its text (what ``echo`` repeats) and the field it
    came from (``messages``, ``prompt`` or ``prompt.[i]``)."""
    ids: list[int]
    text: str
    field: str


def chat_messages(body: dict) -> list[dict[str, str]]:
    """``messages`` as ``{"role", "content"}`` pairs a chat template reads: content a string or a
    list of text parts (OpenAI's two forms, the parts joined by newlines as vLLM joins them)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages': expected a non-empty list of messages", "messages")
    read = []
    for i, message in enumerate(messages):
        where = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise RequestError(400, f"'{where}': expected an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(400, f"'{where}.role': {role!r}; expected one of {', '.join(ROLES)} "
                                    f"(this server has no tool calling)", f"{where}.role")
        read.append({"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")})
    return read


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not (kind == "text" and isinstance(part.get("text"), str)):
                raise RequestError(400, f"'{where}.[{j}]': a {kind!r} part; expected a text part "
                                        f"{{\"type\": \"text\", \"text\": ...}} (text only here)",
                                   f"{where}.[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(400, f"'{where}': expected a string or a non-empty list of text parts", where)


def chat_prompt(body: dict, generator: Generator) -> Prompt:
    from common.prompts import encode_conversation

    messages = chat_messages(body)
    try:
        ids = encode_conversation(generator.tokenizer, messages)
    except ValueError as err:       # no chat template
        raise RequestError(400, str(err), "messages") from None
    return Prompt(ids, generator.decode(ids), "messages")


def completion_prompts(body: dict, generator: Generator) -> list[Prompt]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of lists of them
    (OpenAI's four forms); each one is a prompt of its own."""
    prompt, vocab = body.get("prompt"), generator.backend.limits.vocab_size
    expected = ("'prompt': expected a non-empty string, a list of them, a list of token ids or a list "
                "of lists of token ids")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _token_ids(prompt)):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt):
        raise RequestError(400, expected, "prompt")
    prompts = []
    for i, one in enumerate(prompt):
        field = "prompt" if len(prompt) == 1 else f"prompt.[{i}]"
        if isinstance(one, str) and one:
            prompts.append(Prompt(generator.encode(one, chat_template=False), one, field))
        elif isinstance(one, list) and one and _token_ids(one):
            if not all(0 <= t < vocab for t in one):
                raise RequestError(400, f"'{field}': token ids must lie in 0 .. {vocab - 1} (the "
                                        f"vocabulary)", field)
            prompts.append(Prompt(list(one), generator.decode(one), field))
        else:
            raise RequestError(400, expected, field)
    return prompts


def _token_ids(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def request_params(body: dict, prompt: Prompt, generator: Generator, chat: bool,
                   defaults: dict | None = None) -> Params:
    """A request's options from its fields, each refused in one line: OpenAI's ``max_tokens`` (or
    ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``presence_penalty``,
    ``frequency_penalty``, ``logprobs`` (chat: with ``top_logprobs``; completions: a count, with
    ``echo`` for the prompt's), and vLLM's and llama-server's ``top_k``, ``min_p`` and
    ``repetition_penalty`` (llama-server: ``repeat_penalty``), plus ``speculative``. Unset sampling
    options take ``defaults`` (the model's generation config), else vLLM's; no ``seed`` draws a
    fresh one. ``max_tokens`` defaults to what the KV cache has left after the prompt (as
    llama-server's ``n_predict = -1`` does, bounded)."""
    limits, defaults = generator.backend.limits, defaults or {}
    stop = body_field(body, "stop", (str, list), [], expected="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"'stop': {stop!r}; expected non-empty strings", "stop")
    budget = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = limits.capacity - len(prompt.ids) - limits.lookahead
    max_tokens = body_field(body, budget, int, None, lambda v: v >= 1, "an integer of at least 1")
    needed = capacity_needed(len(prompt.ids), max_tokens or 1, limits)
    if needed > limits.capacity:
        with_max = f" with '{budget}' {max_tokens}" if max_tokens else ""
        raise RequestError(400, f"'{prompt.field}' has {len(prompt.ids)} tokens:{with_max} it needs "
                                f"{needed} KV-cache rows; the capacity is {limits.capacity} (build "
                                f"--max-seq-len)", budget if room >= 1 else prompt.field)
    if "repeat_penalty" in body and "repetition_penalty" in body:
        raise RequestError(400, "'repeat_penalty': give 'repetition_penalty' or 'repeat_penalty', not "
                                "both", "repeat_penalty")
    penalty_name = "repeat_penalty" if "repeat_penalty" in body else "repetition_penalty"

    def sampling(name: str, kind, fallback, check, expected: str):
        return body_field(body, name, kind, defaults.get(name, fallback), check, expected)

    top_k = sampling("top_k", int, 0, lambda v: v >= -1, "-1 or 0 (every token) or more")
    return Params(
        max_new_tokens=max_tokens or room,
        temperature=sampling("temperature", float, 1.0, lambda v: 0 <= v <= 2, "0 .. 2"),
        top_p=sampling("top_p", float, 1.0, lambda v: 0 < v <= 1, "more than 0 and at most 1"),
        top_k=max(top_k, 0),
        min_p=sampling("min_p", float, 0.0, lambda v: 0 <= v <= 1, "0 .. 1"),
        repetition_penalty=body_field(body, penalty_name, float, defaults.get("repetition_penalty", 1.0),
                                      lambda v: 0 < v <= 10, "more than 0 and at most 10 (1: off)"),
        presence_penalty=body_field(body, "presence_penalty", float, 0.0, lambda v: -2 <= v <= 2, "-2 .. 2"),
        frequency_penalty=body_field(body, "frequency_penalty", float, 0.0, lambda v: -2 <= v <= 2,
                                     "-2 .. 2"),
        seed=body_field(body, "seed", int, None) if body.get("seed") is not None else secrets.randbits(63),
        # an extension (llama-server has its per-request ``speculative.n_max``): false decodes
        # this request with the target alone
        speculative=body_field(body, "speculative", bool, True),
        stop=StopStrings(stop, generator.decode) if stop else None,
        **_logprobs(body, chat))


def _logprobs(body: dict, chat: bool) -> dict:
    """``Params.logprobs`` / ``prompt_logprobs`` from OpenAI's fields: chat's ``logprobs`` (a bool)
    and ``top_logprobs``, completions' ``logprobs`` (a count) and ``echo``."""
    bound = f"an integer 0 .. {MAX_LOGPROBS}"
    if chat:
        top = body_field(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, bound)
        wanted = body_field(body, "logprobs", bool, False)
        if top is not None and not wanted:
            raise RequestError(400, "'top_logprobs': needs 'logprobs': true", "top_logprobs")
        return {"logprobs": (top or 0) if wanted else None}
    count = body_field(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, bound)
    echo = body_field(body, "echo", bool, False)
    return {"logprobs": count, "prompt_logprobs": count if echo and count is not None else None}
