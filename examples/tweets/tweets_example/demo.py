"""`tweets-demo`: the tweets example end to end on embedded defaults (what `bash run.sh demo`
runs), and `tweets-demo produce` to add seeded tweets to a pipeline's source.

The demo: a PostgreSQL found or started, onceflow's schema applied and the example's
pipelines registered, seeded tweets produced (a few malformed, poison and flaky), N runs of the
pipeline's Airflow DAG (dag.test(), Spark in local mode through spark-submit), then the
commit log and an independent recount of the source compared with the committed state. Exit
status 1 when the check fails or a run fails.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time

from onceflow.cli import positive_int, run_command
from tweets_example.data import generate
from tweets_example.pipelines import PIPELINES

NAMES = [p.name for p in PIPELINES]


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a share: give 0 to 1")
    return value


def _produce(args, conn, pipeline) -> int:
    events = generate(args.events, seed=args.seed, malformed_share=args.malformed_share,
                      poison_share=args.poison_share, flaky_share=args.flaky_share,
                      start_id=args.start_id)
    started = time.monotonic()
    n = pipeline.source.append(conn, events)
    print(f"produced {n} tweets to {pipeline.source.describe()} in "
          f"{time.monotonic() - started:.1f}s (seed {args.seed}, malformed {args.malformed_share}"
          f", poison {args.poison_share}, flaky {args.flaky_share})")
    return n


def _dsn(for_runs: bool) -> str:
    """The demo's PostgreSQL. In onceflow's checkout (run.sh) its embedded environment finds
    or starts one, and for DAG runs the local Spark and Airflow. Where onceflow is installed
    from its package (docker-compose.yml's image), `produce` uses ONCEFLOW_PG_DSN."""
    from onceflow.core import db
    from onceflow.core.errors import ConfigError

    try:
        from onceflow.dev.demo import prepare_dag_test
        from onceflow.dev.localenv import embedded_env
    except ModuleNotFoundError:
        if for_runs:
            raise ConfigError("the demo's DAG runs need onceflow's checkout (bash run.sh "
                              "demo); with your own Airflow, trigger onceflow_tweets there "
                              "and add tweets with `tweets-demo produce`") from None
        return db.dsn_from_env()
    # for DAG runs, Airflow's in-process API is built while the Spark server starts
    # (run_transactions waits for the server)
    dsn = embedded_env(wait_spark=not for_runs)
    if for_runs:
        prepare_dag_test()
    return dsn


def _setup(args, for_runs: bool = False):
    from onceflow.core import db
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline

    dsn = _dsn(for_runs)
    db.ensure_database(dsn)
    conn = db.connect(dsn)
    db.migrate(conn)
    for p in PIPELINES:
        register(conn, p, create_source=True)
    return dsn, conn, get_pipeline(args.pipeline)


def cmd_produce(args) -> int:
    _, conn, pipeline = _setup(args)
    with conn:
        _produce(args, conn, pipeline)
    return 0


def cmd_run(args) -> int:
    from onceflow.core.db import transaction
    from onceflow.dev.demo import load_dag, run_transactions
    from onceflow.dev.localenv import project_dir
    from onceflow.ops.status import pipeline_status, render
    from onceflow.ops.verify import recount

    started = time.monotonic()
    logging.getLogger("airflow").setLevel(logging.WARNING)  # its output goes to the log file
    _, conn, pipeline = _setup(args, for_runs=True)
    try:
        _produce(args, conn, pipeline)
        dag = load_dag(project_dir() / "dags", f"onceflow_{pipeline.name}")
        log_file = project_dir() / ".run" / "demo.log"
        print(f"running {args.transactions} transaction(s) through the Airflow DAG "
              f"{dag.dag_id} (Airflow and Spark output: {log_file})")
        results = run_transactions(dag, args.transactions, {"batch_size": args.batch_size},
                                   log_file)
        print()
        with transaction(conn) as cur:
            print("\n".join(render(pipeline_status(cur, pipeline.source, pipeline.name,
                                                   args.transactions + 5))))
        print()
        report = recount(conn, pipeline)
    finally:
        conn.close()
    for mismatch in report.mismatches:
        print("  " + mismatch)
    print(report.line())
    code = 0 if report.ok else 1
    failed = [r for r in results if r[1] != "success"]
    if failed:
        print(f"{len(failed)} DAG run(s) failed: see the task logs under .airflow/logs")
        code = 1
    print(f"demo finished in {time.monotonic() - started:.1f}s")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tweets-demo", description="onceflow's tweets example, end to end.",
        epilog="`tweets-demo produce --help` adds tweets only.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="the demo end to end (the default)")
    produce = sub.add_parser("produce", help="append seeded tweets to a pipeline's source")
    for p in (parser, run, produce):
        p.add_argument("--pipeline", choices=NAMES, default="tweets",
                       help="which example pipeline (tweets: PostgreSQL log; tweets_files: "
                            "Parquet segments; tweets_first_seen: a stateful bolt)")
        p.add_argument("--events", type=positive_int, default=60_000,
                       help="how many tweets (60000)")
        p.add_argument("--seed", type=int, default=42, help="random seed (42)")
        p.add_argument("--malformed-share", type=_share, default=0.02,
                       help="share of malformed payloads, 0..1 (0.02)")
        p.add_argument("--poison-share", type=_share, default=0.0005,
                       help="share of tweets whose host the domain bolt refuses: they fail "
                            "every try and end in the dead letters (0.0005)")
        p.add_argument("--flaky-share", type=_share, default=0.001,
                       help="share of tweets whose lookup fails their first 1-2 tries, then "
                            "succeeds on replay (0.001)")
        p.add_argument("--start-id", type=int, default=0, help="first tweet id (0)")
    for p in (parser, run):
        p.add_argument("--transactions", type=positive_int, default=3, help="DAG runs (3)")
        p.add_argument("--batch-size", type=positive_int, default=20_000,
                       help="records per transaction (20000)")
    run.set_defaults(func=cmd_run)
    produce.set_defaults(func=cmd_produce)
    parser.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_command("tweets-demo", args.func, args)
    finally:
        # The interpreter's last garbage collection, as it exits, walks every object that
        # Airflow and the Spark Connect client made: 4 s after a demo had printed its
        # result (measured). Nothing left needs collecting then; frozen objects are skipped.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
