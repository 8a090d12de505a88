"""skiplock.bench.topology's decisions that need no root: where the server binaries come from,
what makes a machine unable to build hosts, and the URLs that name several servers. The
topologies themselves are built by tests/cluster and tests/failover (root only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from skiplock.bench import topology


def test_the_binaries_named_in_the_environment_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(topology.PG_BIN_ENV, str(tmp_path))
    assert topology.postgres_bin() == tmp_path


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal of binaries checked after root")
def test_binaries_the_server_user_cannot_reach_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = tmp_path / "closed"
    binaries = closed / "bin"
    binaries.mkdir(parents=True)
    for name in ("initdb", "pg_ctl"):
        (binaries / name).write_text("")
    closed.chmod(0o700)
    monkeypatch.setenv(topology.PG_BIN_ENV, str(binaries))
    reason = topology.unavailable()
    assert reason is not None and "is closed to other users" in reason, reason
    named = Path(reason.split(": ", 1)[1].split(" is closed")[0])
    assert named == closed or named in closed.parents, reason
    assert "pg_basebackup" in (topology.unavailable(standby=True) or ""), "checked first"


def test_missing_binaries_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topology.PG_BIN_ENV, str(tmp_path))
    reason = topology.unavailable(standby=True)
    assert reason is not None
    if os.geteuid() == 0:
        assert "initdb, pg_ctl, pg_basebackup" in reason and topology.PG_BIN_ENV in reason
    else:
        assert "root" in reason


def test_worker_hosts_are_numbered_from_eleven() -> None:
    assert topology.worker_hosts(3) == {
        "h1": "10.231.0.11",
        "h2": "10.231.0.12",
        "h3": "10.231.0.13",
    }


def test_the_multi_host_urls_name_every_server_and_want_the_writable_one(tmp_path: Path) -> None:
    network = topology.Network("skcl-0", {"db": "10.231.0.1", "standby": "10.231.0.2"})
    servers = [topology.Server(network, tmp_path / h, h) for h in ("db", "standby")]
    remote = conninfo_to_dict(topology.multi_host_url(servers))
    assert remote["host"] == "10.231.0.1,10.231.0.2" and remote["port"] == "5432,5432"
    local = conninfo_to_dict(topology.multi_host_local_url(servers))
    assert local["host"] == f"{tmp_path / 'db' / 'socket'},{tmp_path / 'standby' / 'socket'}"
    for params in (remote, local):
        assert params["target_session_attrs"] == "read-write"
        assert params["connect_timeout"] == str(topology.CONNECT_TIMEOUT)
        assert params["dbname"] == topology.DATABASE


def test_a_topology_without_a_standby_says_so(tmp_path: Path) -> None:
    built = topology.Topology(workers=1)
    try:
        assert built.url == built.primary.url
        with pytest.raises(RuntimeError, match="without a standby"):
            _ = built.standby
    finally:
        built.down()  # nothing was built: only its directory goes
    assert not built.root.exists()
