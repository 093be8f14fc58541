"""Prompts as users give them: JSON Lines files of ``{"turns": [...]}`` (the format of
``../shared/data/prompts``), and their token ids through the tokenizer's chat template."""
from __future__ import annotations

import json
from pathlib import Path


def read_jsonl_prompts(path: Path, flag: str) -> list[str]:
    """The first turn of every record; errors name ``flag``, the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                prompts.append(json.loads(line)["turns"][0])
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise ValueError(f"{flag} {path}:{number}: expected a JSON object with a non-empty "
                                 f"list 'turns'") from None
    return prompts


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of a user message, through the chat template when the tokenizer has one."""
    if chat_template and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer.encode(text, add_special_tokens=False)
