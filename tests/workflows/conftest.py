"""The workflow tests use the semantics suite's fixtures: a migrated schema of the test's
own (``sem``) and real workers over it (``workers``)."""

from semantics.conftest import Calls, RunCli, Sem, StartWorkers, run_cli, sem, workers

__all__ = ["Calls", "RunCli", "Sem", "StartWorkers", "run_cli", "sem", "workers"]
