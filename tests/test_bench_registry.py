"""The bench's registry: every scenario ``skiplock bench --scenarios`` accepts is run by a
module of skiplock.bench that has a ``scenario`` function, and the bench refuses a name
it does not know before it connects anywhere. No database: the smoke test runs them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from skiplock import bench
from skiplock.bench.measure import Settings
from skiplock.cli.bench import SCENARIOS


def test_the_cli_offers_exactly_the_registered_scenarios_in_order() -> None:
    assert tuple(bench.SCENARIOS) == SCENARIOS
    assert set(bench.OWN_SERVERS) <= set(bench.SCENARIOS)


@pytest.mark.parametrize("name", list(bench.SCENARIOS))
def test_each_scenario_has_a_module_that_runs_it(name: str) -> None:
    module = importlib.import_module(f"skiplock.bench.{bench.SCENARIOS[name]}")
    assert callable(module.scenario), name


def test_an_unknown_scenario_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'drian'"):
        bench.run(
            ["drain", "drian"],
            database_url="postgresql://nowhere.invalid/none",
            jobs=1,
            processes=1,
            concurrency=1,
            runs=1,
            history_rows=1,
            as_json=True,
        )


def test_every_option_of_run_reaches_the_scenarios_under_its_own_name() -> None:
    # run() builds Settings from its options by position: the two must list them alike.
    given = [
        name
        for name in inspect.signature(bench.run).parameters
        if name not in ("scenarios", "database_url", "as_json", "worker_args")
    ]
    assert [field.name for field in dataclasses.fields(Settings)] == ["url", "schema", *given]
