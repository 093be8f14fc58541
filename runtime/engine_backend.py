"""What every backend over an engine directory reads from its manifest: the limits and shape facts
that the loop in ``speculative.py`` relies on."""
from __future__ import annotations

from pathlib import Path

from export import manifest as manifest_file


class EngineBackend:
    def __init__(self, engine: str | Path):
        self.directory = Path(engine)
        m = self.manifest = manifest_file.read(self.directory)
        self.vocab_size = m["target"]["vocab_size"]
        self.k = m["draft"]["k"]
        self.confidence_threshold = manifest_file.confidence_threshold(m)
        self.draft_vocab_size = m["draft"]["draft_vocab_size"]
        self.lookahead = lookahead(self.k, m["draft"]["block_size"])
        self.capacity = m["limits"]["max_seq_len"]
        self.max_batch = m["limits"]["max_batch"]
        self.max_prompt_chunk = m["limits"]["max_prompt_chunk"]
        self.eos_token_ids = tuple(m["target"]["eos_token_ids"])

    def check_batch(self, batch: int) -> None:
        check_batch(batch, self.max_batch)

    def file(self, name: str) -> Path:
        """``name`` in the engine directory, refused with what to do when it is missing."""
        path = self.directory / name
        if not path.is_file():
            raise damaged(path, "missing")
        return path


def damaged(path: Path, problem: str, cause: Exception | None = None) -> manifest_file.ManifestError:
    """The error for a file of an engine directory that is missing or cannot be loaded (the reason
    from ``cause``'s first line): the directory has to be rebuilt."""
    if cause is not None:
        problem += f" ({(str(cause).strip().splitlines() or [type(cause).__name__])[0]})"
    return manifest_file.ManifestError(f"{path}: {problem}; rebuild the engine directory with "
                                       f"`python -m export build`")


def lookahead(k: int, block_size: int) -> int:
    """Cache rows a speculative step may write past a sequence's valid length: the verify block
    (``k + 1`` rows) or the draft's scratch block (``block_size`` rows), whichever is longer."""
    return max(k + 1, block_size)


def check_batch(batch: int, max_batch: int) -> None:
    if batch > max_batch:
        raise ValueError(f"batch of {batch} sequences: the engine was built for at most {max_batch} "
                         f"(--max-batch)")
