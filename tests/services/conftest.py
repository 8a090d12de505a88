"""The worker's services run over a schema of each test's own: the fixtures of tests/ops
(``ops``, ``run_worker``, ``run_cli``) serve here too."""

from ops.conftest import Cli, Ops, StartWorker, ops, run_cli, run_worker

__all__ = ["Cli", "Ops", "StartWorker", "ops", "run_cli", "run_worker"]
