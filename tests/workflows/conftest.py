"""The workflow tests use the semantics suite's fixtures: a migrated schema of the test's
own (``sem``) and real workers over it (``workers``)."""

from semantics.conftest import Calls, Sem, StartWorkers, sem, workers

__all__ = ["Calls", "Sem", "StartWorkers", "sem", "workers"]
