"""The flags every server command takes (``python -m runtime.serve``, ``python -m
runtime.ray_serve``), each command's help saying what they mean there, and what they are checked
against before anything loads."""
from __future__ import annotations

import argparse
from pathlib import Path

from runtime.backends import BACKENDS
from runtime.decoding.draft_schedule import DraftSchedule

SCHEDULE = "adaptive|BUSY:DRAFTS,..."


def add_server_flags(p: argparse.ArgumentParser, *, backend: str, threads: str, max_queue: str,
                     draft_schedule: str) -> None:
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--backend", default="ort", choices=BACKENDS, help=backend)
    p.add_argument("--threads", type=int, help=threads)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="the model name clients use [the engine directory's name]")
    p.add_argument("--max-queue", type=int, default=64, help=max_queue)
    p.add_argument("--draft-schedule", metavar=SCHEDULE, help=draft_schedule)
    p.add_argument("--grace-period", type=float, default=10, metavar="SECONDS",
                   help="on SIGINT / SIGTERM, how long running requests may go on before they end "
                        "with 503 [10]")


def check_finite(flag: str, value: float) -> None:
    """Refuse ``value`` in one line unless it is a finite number, at least 0."""
    if not 0 <= value < float("inf"):
        raise ValueError(f"{flag} {value}: expected a finite number, at least 0")


def parse_draft_schedule(engine: str | Path, text: str | None) -> DraftSchedule | None:
    """``--draft-schedule`` for the ``k`` that ``engine``'s manifest records (None: adaptive); the
    manifest and the schedule are refused in one line."""
    from common import manifest

    k = manifest.read(Path(engine))["draft"]["k"]
    return DraftSchedule.parse(text, k) if text else None


def model_name(args: argparse.Namespace) -> str:
    """``--model``, or the engine directory's name."""
    return args.model or Path(args.engine).resolve().name
