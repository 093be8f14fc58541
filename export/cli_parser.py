"""The argument parser of every command line here: a flag is taken only as it is spelled in full
(argparse would take ``--max-new-token`` for ``--max-new-tokens``, and so read a typo as some flag
the user did not mean), and an unknown flag is answered with the known one nearest to it."""
from __future__ import annotations

import argparse
import difflib


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is an error here, with a suggestion (a subcommand's
        parser, which this class makes too, reports its own with its own usage line)."""
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [arg.split("=", 1)[0] for arg in extras if arg.startswith("--")]
        if unknown:
            flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
            near = difflib.get_close_matches(unknown[0], flags, n=1, cutoff=0.6)
            self.error(f"unrecognized argument {unknown[0]}" + (f"; did you mean {near[0]}?" if near else ""))
        return namespace, extras
