"""The parser of the ``skiplock`` command: its errors are one line, not argparse's usage and
exit, and a mistyped option or command gets the nearest one as a suggestion."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterator
from typing import NoReturn

from skiplock.errors import ConfigurationError

_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>.*)' \(choose from (?P<choices>.*)\)$")
_UNRECOGNIZED = "unrecognized arguments: "


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``skiplock: --limit must be ...``,
    raised as UsageError for the command to print and exit 2 (argparse prints its usage
    and exits itself)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            raise UsageError(self._unrecognized(message.removeprefix(_UNRECOGNIZED)))
        option, separator, rest = message.partition(": ")
        if option.startswith("argument ") and separator:  # "argument --limit: must be ..."
            option = option.removeprefix("argument ")
            choice = _INVALID_CHOICE.match(rest)
            if choice is not None:
                raise UsageError(self._invalid_choice(option, choice))
            message = f"{option} {rest}"
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def _unrecognized(self, given: str) -> str:
        """What argparse could not place, with the option meant when one is near it."""
        known = sorted({s for parser in self._tree() for s in _option_strings(parser)})
        hints = []
        for word in given.split():
            name = word.partition("=")[0]
            if not name.startswith("--"):
                continue
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
            if near:
                hints.append(f"did you mean {near[0]}?")
        hint = f"; {' '.join(hints)}" if hints else ""
        return f"unrecognized arguments: {given}{hint} (see `{self.prog} --help`)"

    def _invalid_choice(self, option: str, choice: re.Match[str]) -> str:
        given = choice["given"]
        choices = [c.strip().strip("'") for c in choice["choices"].split(",")]
        near = difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}? " if near else ""
        what = "unknown command" if option.endswith("command") else f"{option}: unknown value"
        return (
            f"{what} {given!r}; {hint}choose from {', '.join(choices)} (see `{self.prog} --help`)"
        )

    def _tree(self) -> Iterator[argparse.ArgumentParser]:
        """This parser and every subcommand's below it."""
        yield self
        for parser in subcommands(self):
            if isinstance(parser, OneLineParser):
                yield from parser._tree()
            else:
                yield parser


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of ``parser``'s own subcommands (one level down)."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.extend(dict.fromkeys(action.choices.values()))  # aliases share a parser
    return found


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        yield from (s for s in action.option_strings if s.startswith("--"))


class UsageError(ConfigurationError):
    """A command line that cannot run, said in one line."""
