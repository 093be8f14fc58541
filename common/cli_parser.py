"""The argument parser of every command line here: a flag is taken only as it is spelled in full
(argparse would take ``--max-new-token`` for ``--max-new-tokens``, and so read a typo as some flag
the user did not mean), an unknown flag is answered with the known one nearest to it when one is
close, and every parse error is one line (argparse prints the whole usage text before it, which
buries the line that says what is wrong)."""
from __future__ import annotations

import argparse
import difflib
import os
import sys

# how alike an unknown flag and a known one must be (difflib's ratio) for the known one to be
# suggested: --temprature -> --temperature (0.96), --max-seq -> --max-seq-len (0.82), but not
# --frobnicate -> --force (0.63), which shares little more than the dashes
SUGGESTION_CUTOFF = 0.8
# flags that replace what exists: a user who mistyped something else must never be steered to them
NEVER_SUGGESTED = frozenset({"--force"})


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        """``prog`` ``python -m MODULE`` is shown as the console script's name (``dspark-chat``)
        when the process was started as one, in usage, errors and the description, so that they
        name the command typed."""
        kwargs.setdefault("allow_abbrev", False)
        prog = kwargs.get("prog")
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        if prog and prog.startswith("python -m ") and script.startswith("dspark-"):
            kwargs["prog"] = script
            if kwargs.get("description"):
                kwargs["description"] = kwargs["description"].replace(prog, script)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is an error here, with a suggestion (a subcommand's
        parser, which this class makes too, reports its own with its own name)."""
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [arg.split("=", 1)[0] for arg in extras if arg.startswith("--")]
        if unknown:
            flags = [flag for flag in self._option_string_actions
                     if flag.startswith("--") and flag not in NEVER_SUGGESTED]
            near = difflib.get_close_matches(unknown[0], flags, n=1, cutoff=SUGGESTION_CUTOFF)
            hint = f"; did you mean {near[0]}?" if near else f" ({self.prog} --help lists the flags)"
            self.error(f"unrecognized argument {unknown[0]}{hint}")
        return namespace, extras

    def error(self, message: str):
        """One line, ``PROG: error: MESSAGE``, and status 2 (argparse's status for bad usage)."""
        self.exit(2, f"{self.prog}: error: {message}\n")
