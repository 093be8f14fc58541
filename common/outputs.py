"""Where the commands write: outputs are checked before the long work that fills them starts, and
an output directory is replaced only by one that was completely built.

A build writes into a fresh directory beside ``--out`` and swaps it in at the end, so a failed or
interrupted build (a typo in ``--target``, a refused flag, Ctrl-C) leaves the previous engine
byte-identical; ``--force`` only says that a finished build may replace it.
"""
from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def writable_file(path: Path, flag: str, force: bool = True) -> Path:
    """``path`` if a file can be written there (its folder exists and is writable; unless
    ``force``, no file is there yet); checked before the work whose result it will hold, so the
    result is never lost at the end."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; expected a file name")
    if path.exists() and not force:
        raise ValueError(f"{flag} {path} exists; pass --force to replace it")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")
    return path


def check_replaceable(out: Path, force: bool, flag: str, sources: tuple[Path, ...] = ()) -> None:
    """Refuse an output directory whose replacement would lose something the user gave: one that
    is, or holds, the current folder or one of ``sources`` (the inputs being read), and a
    non-empty one without ``--force``."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{flag} {out}: is a file; expected a directory")
    resolved = out.resolve()
    for kept, what in ((Path.cwd(), "the current folder"),
                       *((Path(s), f"the input {s}") for s in sources)):
        kept = kept.resolve()
        if kept == resolved or resolved in kept.parents:
            raise ValueError(f"{flag} {out}: replacing it would delete {what}; choose another {flag}")
    if any(out.iterdir()) and not force:
        raise ValueError(f"{flag} {out} exists and is not empty; pass --force to replace it")


@contextmanager
def staged_directory(out: Path, flag: str) -> Iterator[Path]:
    """A new empty directory beside ``out`` to build into; when the block succeeds it takes
    ``out``'s place (an earlier ``out`` is removed only then), when it fails it is removed and
    ``out`` is untouched."""
    out = Path(out)
    staging = _sibling(out, "building")
    try:
        staging.mkdir(parents=True)   # as any directory is made, so the user's umask applies
    except OSError as err:
        raise ValueError(f"{flag} {out}: cannot write there ({err.strerror})") from None
    try:
        yield staging
        if out.exists():
            retired = _sibling(out, "replaced")
            out.rename(retired)
            staging.rename(out)
            shutil.rmtree(retired)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sibling(out: Path, purpose: str) -> Path:
    """A hidden, unused name next to ``out`` (same file system, so renames are atomic)."""
    return out.parent / f".{out.name}.{purpose}-{os.getpid()}-{secrets.token_hex(4)}"
