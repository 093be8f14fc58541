"""What every backend over an engine directory shares: its manifest, read once, and the limits the
scheduler plans with (``base.BackendLimits``)."""
from __future__ import annotations

from pathlib import Path

import torch

from common import manifest as manifest_file
from runtime.backends.base import BackendLimits, Hints


class EngineBackend:
    device = torch.device("cpu")       # where the loop's tensors live (a GPU backend sets its own)
    pooled = False                     # steps on any slots (``base.Backend``)
    hints = Hints()

    def __init__(self, engine: str | Path):
        self.directory = Path(engine)
        self.manifest = manifest_file.read(self.directory)
        self.limits = BackendLimits.from_manifest(self.manifest)

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

