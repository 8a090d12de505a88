"""The README's tutorial, pasted block by block as a newcomer would (issue 25, item 2): its
files written where their first line says (``# myapp/tasks.py``; ``(continued)`` appends),
its shell blocks run in order in one shell, in an empty directory, against a fresh schema.
``skiplock worker`` there runs until no job is ready, running or retrying, then gets the
Ctrl-C the tutorial asks for. A block that stops working fails this test, so the tutorial
cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg
import psycopg.conninfo
import pytest
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "## Five-minute tutorial", "## Failures, back-off and retries"
BLOCK = re.compile(r"```(python|sh)\n(.*?)```", re.DOTALL)
FILE = re.compile(r"# (?P<path>[\w/.]+\.py)(?P<continued> \(continued\))?\n")

# Waits until no job of the schema is ready, running or retrying (a dead or scheduled one
# waits for a human or its time): the moment the tutorial's reader presses Ctrl-C.
IDLE = """
import os, sys, time
import psycopg
from psycopg import sql
query = sql.SQL(
    "SELECT count(*) FROM {}.jobs WHERE state IN ('available', 'running', 'retryable')"
).format(sql.Identifier(os.environ["SKIPLOCK_SCHEMA"]))
deadline = time.monotonic() + 60
with psycopg.connect(os.environ["SKIPLOCK_DATABASE_URL"], autocommit=True) as conn:
    while conn.execute(query).fetchone()[0]:
        if time.monotonic() > deadline:
            sys.exit("the tutorial's jobs did not settle within 60 s")
        time.sleep(0.2)
"""

# The shell the blocks run in: a worker is stopped as the reader would stop it.
PRELUDE = """
set -euo pipefail
skiplock() {
    if [ "$1" = worker ]; then
        command skiplock "$@" &
        local pid=$!
        python3 "$IDLE_SCRIPT" || { kill "$pid"; return 1; }
        kill -INT "$pid"
        wait "$pid"
    else
        command skiplock "$@"
    fi
}
"""


def tutorial_script() -> str:
    """The tutorial as one shell script: files written by heredocs, commands as they are."""
    text = README.read_text()
    section = text[text.index(START) : text.index(END)]
    lines = [PRELUDE]
    for language, body in BLOCK.findall(section):
        if language == "sh":
            lines.append(body)
            continue
        named = FILE.match(body)
        assert named is not None, f"a tutorial block names no file:\n{body}"
        path = named["path"]
        code = body[named.end() :]
        redirect = ">>" if named["continued"] else ">"
        lines.append(f"mkdir -p \"$(dirname '{path}')\"")
        lines.append(f"cat {redirect} '{path}' <<'SKIPLOCK_README'\n\n{code}SKIPLOCK_README")
    return "\n".join(lines)


def test_every_python_block_of_the_tutorial_names_its_file() -> None:
    script = tutorial_script()
    assert script.count("cat > 'myapp/tasks.py'") == 1
    assert script.count("cat >> 'myapp/tasks.py'") == 2  # charge_card, mark_shipped


@pytest.mark.second_server  # no server dependence: run where the suite has time to spare
@pytest.mark.timeout(300)
def test_the_tutorial_runs_as_pasted(database_url: str, tmp_path: Path) -> None:
    schema = f"tutorial_{uuid.uuid4().hex[:8]}"
    (tmp_path / "idle.py").write_text(textwrap.dedent(IDLE))
    (tmp_path / "tutorial.sh").write_text(tutorial_script())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    # The tutorial's own table lands in its schema too (first on the search path), so that
    # dropping the schema leaves the shared test database as it was.
    url = psycopg.conninfo.make_conninfo(database_url, options=f"-csearch_path={schema}")
    env.update(
        SKIPLOCK_DATABASE_URL=url,
        SKIPLOCK_SCHEMA=schema,
        IDLE_SCRIPT=str(tmp_path / "idle.py"),
        # python3 and skiplock as installed with the project.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    workdir = tmp_path / "tutorial"
    workdir.mkdir()
    try:
        done = subprocess.run(
            ["bash", str(tmp_path / "tutorial.sh")],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )
            admin.execute("DROP TABLE IF EXISTS tutorial_orders")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said  # set -e: any command that failed, a script that raised
    assert "order 1234 and its receipt job 1 committed together" in said
    assert "100 receipts in one INSERT, and one more in a minute" in said
    assert "receipt for order 2099 sent" in said  # the worker ran the bulk's last job
    # The dead job's story, as jobs show tells it, and the commands after it.
    assert "RuntimeError: card service unavailable" in said
    assert re.search(r"attempt 3 failed at .*: RuntimeError: card service unavailable", said), said
    retried = re.search(r"^job (\d+) made available again$", said, re.M)
    assert retried is not None, said
    assert f"job {retried[1]} cancelled" in said
