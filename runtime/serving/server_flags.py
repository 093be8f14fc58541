"""The flags every server command takes (``python -m runtime.serve``, ``python -m
runtime.ray_serve``), each command's help saying what they mean there, and the check of their
numbers before anything loads."""
from __future__ import annotations

import argparse
from pathlib import Path

from runtime.backends import BACKENDS

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


def stopping_line(grace: float) -> str:
    """What a server says when SIGINT / SIGTERM starts its stop, which may take the grace period."""
    return (f"stopping: running requests have {grace:g} s (--grace-period) to finish, then end with "
            f"503; no new ones are taken")


def check_port(flag: str, value: int) -> None:
    """Refuse ``value`` in one line unless it is a TCP port (0: any free one)."""
    if not 0 <= value <= 65535:
        raise ValueError(f"{flag} {value}: expected a port number, 0 .. 65535")


def check_finite(flag: str, value: float) -> None:
    """Refuse ``value`` in one line unless it is a finite number, at least 0."""
    if not 0 <= value < float("inf"):
        raise ValueError(f"{flag} {value}: expected a finite number, at least 0")


def model_name(args: argparse.Namespace) -> str:
    """``--model``, or the engine directory's name."""
    return args.model or Path(args.engine).resolve().name
