"""The code that runs jobs stays readable (issue 22): no function in the worker, the
executor, the completer or the CLI is longer than a screen. Static: it reads the sources."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "skiplock"
WATCHED = [
    *sorted((PACKAGE / "worker").glob("*.py")),
    *sorted((PACKAGE / "cli").glob("*.py")),
    PACKAGE / "executor.py",
    PACKAGE / "completer.py",
]
LONGEST = 60  # lines, from the def (its decorators aside) to its last line


def long_functions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > LONGEST:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length}")
    return found


def test_no_function_in_the_job_path_is_longer_than_a_screen() -> None:
    assert len(WATCHED) > 30  # the worker's and the CLI's modules were found
    assert [line for path in WATCHED for line in long_functions(path)] == []
