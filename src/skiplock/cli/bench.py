"""``skiplock demo`` and ``skiplock bench``: the seed lesson's scenario, and the
benchmarks (skiplock.bench)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from skiplock.command_line import (
    CONCURRENCY,
    PROCESSES,
    CommaSeparated,
    count,
    prefetch_setting,
    seconds,
)
from skiplock.errors import ConfigurationError

SCENARIOS = (
    "enqueue",
    "drain",
    "ceiling",
    "latency",
    "seed",
    "history",
    "scheduled",
    "pressure",
    "unique",
    "ordered",
    "keylimit",
    "lowconc",
    "enqueue-concurrent",
    "wakeup",
    "late-commit",
    "dashboard",
    "workflow",
    "steps",
    "signals",
    "steps-chaos",
    "hosts",
    "failover",
)
# bench --phases and --clients
phases = CommaSeparated(seconds(), "seconds")
client_counts = CommaSeparated(count(1, 1000), "client counts")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="run the seed lesson's scenario: 400 jobs, 4 workers, a SIGKILLed worker"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--demo-schema",
        default="skiplock_demo",
        help="scratch schema the demo drops and rebuilds (default: %(default)s)",
    )
    p.add_argument(
        "--prefetch",
        type=prefetch_setting,
        default=None,
        metavar="auto|N",
        help="jobs each worker claims beyond its free slot (default auto; 0 as the lesson)",
    )
    p.set_defaults(func=run_demo)

    _add_bench_parser(sub)


def _add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure throughput and latency (medians of --runs)")
    p.add_argument(
        "--scenarios",
        default="enqueue,drain,ceiling,latency,seed,history,scheduled",
        help="comma-separated, from: " + ", ".join(SCENARIOS),
    )
    p.add_argument("--jobs", type=count(1), default=100_000)
    p.add_argument("--processes", type=PROCESSES, default=2, help="worker processes")
    p.add_argument("--concurrency", type=CONCURRENCY, default=200, help="per worker process")
    p.add_argument("--runs", type=count(1), default=3)
    p.add_argument("--history-rows", type=count(0), default=1_000_000)
    p.add_argument(
        "--rate",
        type=count(1),
        default=1000,
        help="pressure, failover and late-commit: jobs/s offered",
    )
    p.add_argument(
        "--phases",
        type=phases,
        default="20,60,180,60",
        help="pressure: seconds of warm-up, clean, held and recovery (default %(default)s)",
    )
    p.add_argument(
        "--enqueue-seconds",
        type=seconds(above_zero=True),
        default=20.0,
        help="enqueue-concurrent: seconds per run and client count; late-commit: seconds "
        "per variant (default %(default)s)",
    )
    p.add_argument(
        "--clients",
        type=client_counts,
        default="8,32,64",
        help="enqueue-concurrent: the numbers of concurrent clients (default %(default)s)",
    )
    p.add_argument(
        "--samples",
        type=count(1, 100_000),
        default=200,
        help="wakeup and latency: jobs timed per insert path and run (default %(default)s)",
    )
    p.add_argument(
        "--promote-after",
        type=seconds(),
        default=0.0,
        metavar="SECONDS",
        help="failover: seconds from the standby noticing the loss to its promotion, as a "
        "failover manager waits out its own timeouts (default %(default)s)",
    )
    p.add_argument(
        "--worker-args",
        default="",
        help="extra options for the bench's worker processes, e.g. '--prefetch 10'",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_bench)


def run_demo(args: argparse.Namespace) -> int:
    from skiplock import demo  # noqa: PLC0415

    return demo.main(args.database_url, args.demo_schema, args.json, args.prefetch)


def run_bench(args: argparse.Namespace) -> int:
    from skiplock import bench  # noqa: PLC0415

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for name in scenarios:
        if name not in SCENARIOS:
            raise ConfigurationError(
                f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}"
            )
    return bench.run(
        scenarios,
        database_url=args.database_url,
        jobs=args.jobs,
        processes=args.processes,
        concurrency=args.concurrency,
        runs=args.runs,
        history_rows=args.history_rows,
        as_json=args.json,
        rate=args.rate,
        phase_seconds=args.phases,
        enqueue_seconds=args.enqueue_seconds,
        clients=args.clients,
        samples=args.samples,
        worker_args=shlex.split(args.worker_args),
        promote_after=args.promote_after,
    )
