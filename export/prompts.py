"""Prompts as users give them: JSON Lines files of ``{"turns": [...]}`` (the format of
``data/prompts``), and their token ids through the tokenizer's chat template."""
from __future__ import annotations

import json
from pathlib import Path

# distill's default prompts, and the held-out text of the build's quality cost (its last records)
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts" / "gsm8k.jsonl"


def read_jsonl_prompts(path: Path, flag: str) -> list[str]:
    """The first turn of every record (``read_jsonl_conversations``)."""
    return [turns[0] for turns in read_jsonl_conversations(path, flag)]


def read_jsonl_conversations(path: Path, flag: str) -> list[list[str]]:
    """The user turns of every record; errors name ``flag``, the file and the line. A file with no
    record is refused, so that a wrong file never reads as an empty set of prompts."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    text = utf8_text(path.read_bytes(), f"{flag} {path}")
    conversations = []
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError):
                turns = None
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise ValueError(f"{flag} {path}:{number}: expected a JSON object with a non-empty "
                                 f"list 'turns' of strings")
            conversations.append(turns)
    if not conversations:
        raise ValueError(f"{flag} {path}: no prompts; expected JSON Lines of {{\"turns\": [...]}}")
    return conversations


def utf8_text(data: bytes, source: str) -> str:
    """``data`` decoded as UTF-8; otherwise an error that names ``source`` and the line (a prompt
    with undecodable bytes would reach the tokenizer as lone surrogates and fail deep inside it)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{source}:{line}: not UTF-8 text (byte {data[err.start]:#04x}); expected "
                         f"UTF-8") from None


def encode_prompt(tokenizer, text: str, chat_template: bool = True,
                  system: str | None = None) -> list[int]:
    """Token ids of a user message (after a ``system`` message, which needs the chat template),
    through the chat template when the tokenizer has one."""
    messages = [{"role": "user", "content": text}]
    if system is not None:
        if not (chat_template and tokenizer.chat_template):
            raise ValueError("--system: needs the tokenizer's chat template (the engine's tokenizer has "
                             "none, or --no-chat-template was given)")
        messages.insert(0, {"role": "system", "content": system})
    if chat_template and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer.encode(text, add_special_tokens=False)


def encode_conversation(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation (``{"role", "content"}`` messages) up to the assistant's next
    turn, through the chat template, which a conversation needs."""
    if not tokenizer.chat_template:
        raise ValueError("a conversation needs the tokenizer's chat template, and the engine's "
                         "tokenizer has none")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
