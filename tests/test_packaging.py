"""What ships: the sdist and wheel built as a release would be (``python -m build``),
checked as PyPI checks them (``twine check --strict``), holding every file skiplock reads
at run time, depending on psycopg without forcing its binary wheel, and carrying the
version ``skiplock.__version__`` and ``skiplock --version`` report."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import skiplock
from skiplock import cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "skiplock"

# No server: run once, on the half of the suite with time to spare.
pytestmark = pytest.mark.second_server


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build tools of the dev extra, not a fresh download of them.
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def wheel(dist: Path) -> Path:
    (found,) = dist.glob("skiplock-*.whl")
    return found


def test_twine_finds_nothing_to_refuse(dist: Path) -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
        check=False,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout


def test_the_wheel_holds_every_file_read_at_run_time(dist: Path) -> None:
    names = set(zipfile.ZipFile(wheel(dist)).namelist())
    wanted = {
        f"skiplock/{path.relative_to(PACKAGE).as_posix()}"
        for pattern in ("migrations/*.sql", "dashboard/templates/*", "dashboard/static/*")
        for path in PACKAGE.glob(pattern)
    }
    assert len(wanted) > 30  # the migrations alone
    assert wanted | {"skiplock/py.typed"} <= names
    assert not any("__pycache__" in name for name in names)


def test_the_sdist_holds_the_sources_and_the_changelog(dist: Path) -> None:
    (sdist,) = dist.glob("skiplock-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"README.md", "CHANGELOG.md", "pyproject.toml"} <= names
    assert "src/skiplock/migrations/0001_jobs.sql" in names


def test_psycopg_is_required_and_its_binary_wheel_only_through_the_extra(dist: Path) -> None:
    with zipfile.ZipFile(wheel(dist)) as archive:
        (metadata,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(archive.read(metadata))
    required = message.get_all("Requires-Dist") or []
    core = [r for r in required if "extra ==" not in r]
    assert any(r.startswith("psycopg<") or r.startswith("psycopg>") for r in core), core
    assert not any("binary" in r for r in core), core
    assert any("psycopg[binary]" in r and 'extra == "binary"' in r for r in required), required
    assert message["Version"] == skiplock.__version__


def test_the_version_at_run_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"skiplock {skiplock.__version__}\n"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {skiplock.__version__}" in changelog


# -- the documentation site --------------------------------------------------------------


def test_the_documentation_site_builds_with_no_broken_link(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    # The API reference is generated from the docstrings: the App and one of its methods.
    assert 'id="skiplock.App"' in reference
    assert 'id="skiplock.App.signal"' in reference


def test_every_decision_is_listed_in_the_decisions_index() -> None:
    decisions = ROOT / "docs" / "decisions"
    index = (decisions / "index.md").read_text()
    pages = sorted(p.name for p in decisions.glob("[0-9]*.md"))
    assert len(pages) >= 27
    assert [p for p in pages if f"]({p})" not in index] == []
