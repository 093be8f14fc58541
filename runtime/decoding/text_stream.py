"""Streaming text from token ids that arrive several at a time: each piece is what no later token
can change. A piece waits for whole characters (a byte-level tokenizer splits them) and for a
stop string that may be forming at its end; the text after a stop string is never shown."""
from __future__ import annotations

from typing import Callable

from runtime.decoding.stop_strings import StopStrings


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: StopStrings | None = None):
        self.decode, self.stop, self.shown = decode, stop, ""

    def text(self, ids: list[int]) -> str:
        """The whole text of ``ids``, cut at the first stop string."""
        text = self.decode(ids)
        return self.stop.cut(text) if self.stop else text

    def piece(self, ids: list[int], final: bool = False) -> str:
        """What ``ids`` (all of them so far) add to the text shown; with ``final``, everything held
        back too."""
        if final:
            text = self.text(ids)
        else:
            text = self.decode(ids)
            if self.stop:
                text = self.stop.settled(text)
            if text.endswith("\ufffd"):
                return ""
        if not text.startswith(self.shown) or len(text) == len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece
