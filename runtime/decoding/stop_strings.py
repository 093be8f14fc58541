"""Stop strings: a sequence ends at the first token that completes one of them, and its text ends
before it (as OpenAI's ``stop`` and llama.cpp's ``--reverse-prompt`` do). A verify step emits
several tokens at once, so the check runs after every token of a step, and text streamed while a
stop string may still be forming holds back the part that could be its beginning."""
from __future__ import annotations

from typing import Callable


class StopStrings:
    def __init__(self, strings: list[str], decode: Callable[[list[int]], str]):
        if any(not s for s in strings):
            raise ValueError("stop string '': expected a non-empty string")
        self.strings, self.decode = tuple(strings), decode
        # an occurrence that ends in the last token lies in the last (its UTF-8 length) tokens,
        # each at least a byte; a few more keep a tokenizer's start-of-text rules off it
        self.window = max(len(s.encode("utf-8")) for s in strings) + 4 if strings else 0

    def reached(self, ids: list[int]) -> bool:
        """Whether the text of ``ids`` holds a stop string (checked after each new token: only
        an occurrence that ends in the last one can be new)."""
        if not self.strings:
            return False
        tail = self.decode(ids[-self.window:])
        return any(s in tail for s in self.strings)

    def cut(self, text: str) -> str:
        """``text`` up to its first stop string."""
        ends = [text.find(s) for s in self.strings if s in text]
        return text[:min(ends)] if ends else text

    def settled(self, text: str) -> str:
        """The part of ``text`` that no stop string can take back: cut at the first stop string,
        less a tail that begins one."""
        text = self.cut(text)
        for length in range(min(len(text), max(map(len, self.strings), default=0)), 0, -1):
            if any(s.startswith(text[-length:]) for s in self.strings):
                return text[:-length]
        return text
