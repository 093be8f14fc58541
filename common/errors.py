"""The errors ``python -m export`` reports as one line, kept in a module with no heavy imports so
that the command line can name them (and print ``--help``) without loading torch or onnx; and how a
command line reports them (``run_command``), shared by ``python -m export`` and ``python -m distill``."""
from __future__ import annotations

import signal
import sys
from typing import Callable


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and field at fault."""


class VerificationError(RuntimeError):
    """An exported graph disagrees with its PyTorch reference."""


class EngineBuildError(RuntimeError):
    """An engine could not be built; the message names the graph and the reason."""


def run_command(command: Callable[[], None], interrupted: str) -> None:
    """Run a command line's ``command`` the way this project's commands end: an expected failure
    (a ``ValueError``, which ``CheckpointError`` and ``ManifestError`` are, or an export error) as
    one ``error:`` line and exit status 1, an ``OSError`` with ``interrupted`` (what it left
    behind), Ctrl-C as ``interrupted: ...`` and status 130. A plain ``kill`` ends the process through
    ``SystemExit``, so that a half-written output is removed as on any other failure (its default
    action would leave the hidden staging folder behind)."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        command()
    except (ValueError, VerificationError, EngineBuildError) as err:
        raise SystemExit(f"error: {err}") from None
    except OSError as err:   # a full disk, a folder that became unwritable mid-build
        where = f" ({err.filename})" if err.filename else ""
        raise SystemExit(f"error: {err.strerror or err}{where}; {interrupted}") from None
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        raise SystemExit(130) from None


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)
