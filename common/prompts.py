"""Prompts as users give them: JSON Lines files of ``{"turns": [...]}`` (the format of
``data/prompts``), and their token ids through the tokenizer's chat template."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

# distill's default prompts, and the held-out text of the build's quality cost (its last records)
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts" / "gsm8k.jsonl"
# beside a draft: the prompts it was distilled on, as data (``python -m distill`` writes it into its
# --out; the demo draft ships its own), so that ``python -m bench`` can refuse to measure on them
TRAINING_RECORD = "training.json"


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


def file_checksum(path: Path) -> str:
    """``sha256:HEX`` of a file's bytes, as manifest.json records checkpoint files."""
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def training_record(files: list[tuple[Path, int]], about: str) -> dict:
    """A draft's ``training.json``: for each prompts file (with its checksum, by which a copy of
    it elsewhere is recognised), the records it was trained on, ``[first, end)`` 0-based over
    the file's records (its non-blank lines), as ``read_jsonl_prompts`` numbers them."""
    return {"about": about,
            "prompts": [{"file": str(path), "checksum": file_checksum(path), "records": [0, end]}
                        for path, end in files]}


def check_training_record(record: dict, path: Path) -> dict:
    """``record`` (read from ``path``) if it is a ``training.json``; otherwise one line naming the
    file and field."""
    def pair(value) -> bool:
        return isinstance(value, list) and len(value) == 2 and all(type(i) is int and i >= 0 for i in value)

    entries = record.get("prompts")
    if not (isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("checksum"), str)
                                              and pair(e.get("records")) for e in entries)):
        raise ValueError(f"{path}: field 'prompts': expected a list of {{\"file\", \"checksum\", "
                         f"\"records\": [first, end]}} objects")
    if not isinstance(record.get("draft_files", {}), dict):
        raise ValueError(f"{path}: field 'draft_files': expected an object of file names and checksums")
    return record


def trained_records(record: dict, prompts_file: Path) -> range:
    """The records of ``prompts_file`` that a ``training.json`` says the draft was trained on
    (empty when it names no file with these bytes)."""
    checksum = file_checksum(prompts_file)
    return next((range(*entry["records"]) for entry in record["prompts"] if entry["checksum"] == checksum),
                range(0))
