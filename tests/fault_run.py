"""A long fault run: the fault tests' harness (onceflow_testing.faults), for longer and more seeds.
It lives with the tests, whose harness it runs (a checkout's tool, not a benchmark).

    .venv/bin/python tests/fault_run.py --transactions 60
    .venv/bin/python tests/fault_run.py --transactions 30 --seeds 5 --mode both

For each seed and mode: a private PostgreSQL cluster of its own (crashed in immediate mode
between staging and commit, among the other faults), the tweets example's pipeline over
generated tweets (malformed, poison and flaky ones among them), ``--transactions`` txids
committed under faults, then a drain without faults, then the check. A fault counts once it
happened (an agent died of the SIGKILL at the step drawn, the server came back with a new
start time, ...): each run prints, per kind, how many were drawn and how many happened, and a
drawn fault that did not happen makes the run WRONG. The expected state comes
from the generated payloads alone (the example's ``recount``, in plain Python), never from
onceflow's bookkeeping: url and domain counts, rejected records, dead letters, an empty
backflow queue, and committed ranges that tile every partition from 0 to its head.

Exit status: 0 when every run ends exact, 1 when one does not (its seed is printed: rerun it
with ``--seed``), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import time
from collections import Counter
from pathlib import Path


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def differences(conn, pipeline, payloads: list[str]) -> list[str]:
    """What differs between the committed state and what the payloads say it must be."""
    from tweets_example.data import recount

    want = recount(payloads, pipeline)
    problems = []

    def rows(query: str, *args):
        with conn.cursor() as cur:
            cur.execute(query, args)
            out = cur.fetchall()
        conn.commit()
        return out

    for table in ("url_counts", "domain_counts"):
        got = Counter(dict(rows(f"SELECT key, value FROM {table} WHERE value <> 0")))  # noqa: S608
        expected = want.counts[table]
        if got != expected:
            missing, extra = expected - got, got - expected
            problems.append(f"{table}: {sum(missing.values())} counts missing, "
                            f"{sum(extra.values())} extra (e.g. {list(missing or extra)[:3]})")
    checks = {
        "rejected records": (rows("SELECT count(*) FROM rejected_records")[0][0],
                             sum(want.rejected.values())),
        "dead letters": (rows("SELECT count(*) FROM dead_letters")[0][0],
                         sum(want.failing.values())),
        "backflow items left": (rows("SELECT count(*) FROM backflow_items")[0][0], 0),
    }
    problems += [f"{name}: {got}, expected {expected}"
                 for name, (got, expected) in checks.items() if got != expected]
    ends: dict[int, int] = {}
    for partition, start, end in rows(
            """SELECT b.partition, b.start_offset, b.end_offset FROM batch_ranges b
               JOIN transactions t USING (pipeline, txid)
               WHERE t.state = 'committed' AND t.pipeline = %s ORDER BY 1, 2""", pipeline.name):
        if start != ends.get(partition, 0):
            problems.append(f"partition {partition}: committed ranges jump from "
                            f"{ends.get(partition, 0)} to {start}")
        ends[partition] = end
    heads = dict(rows("SELECT partition, next_offset FROM source_partitions"))
    if ends != heads:
        problems.append(f"committed ranges end at {ends}, the partitions' heads are {heads}")
    return problems


def one_run(spark, args, seed: int, mode: str) -> bool:
    from onceflow.core import db
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline
    from onceflow.dev.localpg import crash_restart, start_private, stop_private
    from onceflow_testing.faults import FaultRun
    from tweets_example.data import generate

    data_dir = Path("/var/tmp") / f"onceflow-fault-run-{os.getpid()}-{seed}-{mode}"
    started = time.monotonic()
    dsn = start_private(data_dir, free_port())
    try:
        db.ensure_database(dsn)
        with db.connection(dsn) as conn:
            db.migrate(conn)
        os.environ["ONCEFLOW_PG_DSN"] = dsn  # the agents (killed processes) connect with it
        settings = {"batch_size": args.batch_size, "mode": mode, "max_pending": 3}
        pipeline = get_pipeline("tweets", **settings)
        payloads = list(generate(args.events, seed=seed % 1000, malformed_share=0.04,
                                 poison_share=0.01, flaky_share=0.02))
        conn = db.connect(dsn)
        register(conn, pipeline, create_source=True)
        pipeline.source.append(conn, payloads)
        conn.close()
        run = FaultRun(pipeline, dsn, spark, seed, settings=settings,
                       restart_postgres=None if args.no_postgres_crash
                       else (lambda: crash_restart(data_dir)),
                       rate=args.rate)
        run.run(transactions=args.transactions, max_steps=args.max_steps)
        run.drain()
        run.close()
        conn = db.connect(dsn)
        problems = differences(conn, pipeline, payloads)
        conn.close()
        took = time.monotonic() - started
        if run.missed:  # a fault drawn that did not happen: the run did not test it
            problems += [f"fault not done: {why}" for why in run.missed]
        verdict = "EXACT" if not problems else "WRONG"
        print(f"seed {seed} {mode}: {verdict} after {run.steps} steps, {run.runs} runs, "
              f"{took:.0f} s; faults (attempted / happened):\n{run.table()}\n"
              f"outcomes {dict(sorted(run.outcomes.items()))}", flush=True)
        for problem in problems:
            print(f"  {problem}", flush=True)
        return not problems
    finally:
        stop_private(data_dir)
        if not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    from onceflow.dev import use_examples

    use_examples()  # the checkout's examples (code, pipelines), as `bash run.sh demo` has them
    # the fault harness (tests/onceflow_testing), which Python finds beside this script, for
    # the agents it starts too
    tests = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, os.environ["PYTHONPATH"]])
    parser = argparse.ArgumentParser(
        description="Run the tweets pipeline under random real faults (SIGKILLs inside "
                    "staging and commit, PostgreSQL crashes, duplicate triggers, zombies, "
                    "silent deaths), then check the result against the generated data.",
        epilog=__doc__.split("\n\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transactions", type=int, default=30,
                        help="txids to commit under faults, per run (default 30)")
    parser.add_argument("--events", type=int, default=None,
                        help="tweets to generate (default: enough for the transactions and "
                             "a drain: 1.5 x transactions x batch size)")
    parser.add_argument("--batch-size", type=int, default=150,
                        help="records per transaction, across partitions (default 150)")
    parser.add_argument("--mode", choices=("transactional", "opaque", "both"), default="both")
    parser.add_argument("--seed", type=int, default=20261123, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="runs per mode, seeds counting up")
    parser.add_argument("--rate", type=float, default=0.2,
                        help="chance of a fault at each point (default 0.2)")
    parser.add_argument("--max-steps", type=int, default=5000,
                        help="give up when this many steps commit too little (default 5000)")
    parser.add_argument("--no-postgres-crash", action="store_true",
                        help="no PostgreSQL crashes (e.g. when not allowed to run pg_ctl)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the private clusters' data folders (under /var/tmp)")
    args = parser.parse_args(argv)
    for name in ("transactions", "batch_size", "seeds", "max_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not "
                         f"{getattr(args, name)}")
    if not 0.0 <= args.rate <= 1.0:
        parser.error(f"--rate must be between 0 and 1, not {args.rate}")
    if args.events is None:
        args.events = int(1.5 * args.transactions * args.batch_size)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from onceflow.spark.session import get_spark

    spark = get_spark("onceflow-fault-run", master="local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    modes = ("transactional", "opaque") if args.mode == "both" else (args.mode,)
    print(f"fault run: {args.transactions} transactions, {args.events} events, "
          f"rate {args.rate}, modes {', '.join(modes)}; load average {loadavg()}", flush=True)
    results = []
    try:
        for seed in range(args.seed, args.seed + args.seeds):
            for mode in modes:
                results.append((seed, mode, one_run(spark, args, seed, mode)))
    finally:
        spark.stop()
    wrong = [(seed, mode) for seed, mode, ok in results if not ok]
    print(f"{len(results) - len(wrong)} of {len(results)} runs exact; "
          f"load average {loadavg()}")
    for seed, mode in wrong:
        print(f"  rerun: tests/fault_run.py --seed {seed} --mode {mode} "
              f"--transactions {args.transactions}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
