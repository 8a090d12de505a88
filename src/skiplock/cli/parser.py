"""The parser of the ``skiplock`` command: its errors are one line, not argparse's usage and
exit."""

from __future__ import annotations

import argparse
from typing import NoReturn

from skiplock.errors import ConfigurationError


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``skiplock: --limit must be ...``,
    raised as UsageError for the command to print and exit 2 (argparse prints its usage
    and exits itself)."""

    def error(self, message: str) -> NoReturn:
        option, separator, rest = message.partition(": ")
        if option.startswith("argument ") and separator:  # "argument --limit: must be ..."
            message = f"{option.removeprefix('argument ')} {rest}"
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class UsageError(ConfigurationError):
    """A command line that cannot run, said in one line."""
