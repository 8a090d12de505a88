"""Every number the ``skiplock`` command takes, given out of its range (negative, zero
where zero means nothing, past bigint, NaN and infinities), is refused in one line that
names the option, with exit status 2 and no traceback. The options are read from the
parser itself, so a new one cannot be left out; each case runs the real command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from skiplock import cli, command_line
from skiplock.cli import bench
from skiplock.cli.parser import UsageError

ROOT = Path(__file__).resolve().parent.parent
HUGE = "99999999999999999999"  # past bigint
# A value for each positional a command needs besides the one tried.
POSITIONALS = {"app": "tests.crash_app:app", "queue": "default", "role": "someone", "id": "1"}


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Each command's parser, with the words that reach it (``("jobs", "list")``)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def bad_values(kind: Callable[[str], Any]) -> list[str]:
    """Values out of ``kind``'s range: below its minimum, past its maximum (and bigint),
    and, for a number that may have a fraction, NaN and both infinities. (A plain int or
    float, which test_every_numeric_option_has_bounds refuses, gets -1 and the rest.)"""
    if kind is int or getattr(kind, "__name__", "") == "prefetch_setting":
        return ["-1", HUGE]
    if kind is float:
        return ["-1", HUGE, "nan", "inf", "-inf"]
    if kind is bench.phases:
        return ["20,-1,180,60", "20,nan,180,60", f"20,{HUGE}e9,180,60"]
    if kind is bench.client_counts:
        return ["8,0", "8,1001", f"8,{HUGE}", "8,x"]
    assert isinstance(kind, command_line.Number), f"give {kind!r} bounds (command_line.Number)"
    below = kind.minimum if kind.above else kind.minimum - 1
    values = [repr(int(below)) if kind.whole else repr(float(below)), HUGE]
    if kind.maximum < int(HUGE):
        values.append(str(int(kind.maximum) + 1))
    return values if kind.whole else [*values, "nan", "inf", "-inf"]


def cases(command: str | None = None) -> list[tuple[list[str], str]]:
    """(the command line, the option named in its refusal) for every numeric option (of
    ``command``, ``"jobs list"`` say, when given)."""
    found = []
    for path, parser in parsers(cli.build_parser()):
        if command is not None and " ".join(path) != command:
            continue
        for action in parser._actions:
            kind = action.type
            if kind is None or kind is str or not callable(kind):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            others = [
                POSITIONALS[other.dest]
                for other in parser._actions
                if not other.option_strings
                and other is not action
                and other.required
                and other.dest in POSITIONALS
            ]
            for value in bad_values(kind):
                given = [f"{name}={value}"] if action.option_strings else [value]
                found.append(([*path, *others, *given], name))
    return found


def test_every_numeric_option_has_bounds() -> None:
    kinds = {
        type(action.type).__name__ if isinstance(action.type, command_line.Number) else action.type
        for _, parser in parsers(cli.build_parser())
        for action in parser._actions
        if action.type is not None and action.type is not str
    }

    assert int not in kinds and float not in kinds, kinds
    assert len(cases()) > 100


def refusal(url: str, command: list[str]) -> tuple[int | None, str]:
    """The exit status and stderr of ``skiplock --database-url URL COMMAND`` (None if it
    did not end within 30 s: it took the value and ran)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "skiplock", "--database-url", url, *command],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=30,
            env=env,
            cwd=ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired as late:
        err = late.stderr.decode() if isinstance(late.stderr, bytes) else (late.stderr or "")
        return None, err
    return done.returncode, done.stderr


def parser_refusal(command: list[str]) -> str | None:
    """What the parser says of ``skiplock COMMAND`` (None if it took the values). A value
    the parser lets through would reach the command itself: that is the failure."""
    try:
        cli.build_parser().parse_args(["--database-url", "postgresql://nobody@invalid/x", *command])
    except UsageError as exc:
        return str(exc)
    return None


def test_every_numeric_option_refuses_values_out_of_range() -> None:
    # In the parser: main() prints a UsageError as one line, "skiplock: ...", exit 2
    # (the subprocess test below shows it for the real command).
    wrong = []
    for command, name in cases():
        said = parser_refusal(command)
        if said is None or "\n" in said or not said.startswith(f"{name} must be "):
            wrong.append(f"skiplock {' '.join(command)}: {said!r}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize(
    "command",
    [
        ["jobs", "list", "--limit", "-1"],
        ["jobs", "retry", HUGE],
        ["status", "--watch", "-1"],
        ["prune", "--retention-days", "nan"],
        ["worker", "tests.crash_app:app", "--history-retention-days=1e9"],
    ],
    ids=" ".join,
)
def test_the_real_command_refuses_in_one_line_with_exit_2(
    database_url: str, command: list[str]
) -> None:
    code, err = refusal(database_url, command)

    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("skiplock: ") and " must be " in err, err
