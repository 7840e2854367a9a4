"""The `onceflow` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from onceflow import db

EPILOG = """\
PostgreSQL: ONCEFLOW_PG_DSN (default postgresql://postgres@127.0.0.1:5432/onceflow).
`onceflow demo` and `onceflow ui` find or start a PostgreSQL themselves (see `onceflow pg`).
"""


def _pipeline(args):
    from onceflow.pipeline import get_pipeline

    return get_pipeline(args.pipeline)


def cmd_pg(args) -> int:
    from onceflow.localenv import project_dir
    from onceflow.localpg import ensure_postgres, private_data_dir, stop_private

    if args.stop:
        stop_private(private_data_dir(project_dir()))
        return 0
    dsn, how = ensure_postgres(project_dir())
    print(f"onceflow: using {how}", file=sys.stderr)
    print(dsn)
    return 0


def cmd_init(args) -> int:
    from onceflow.coordinator import register
    from onceflow.pipelines import PIPELINES

    dsn = db.dsn_from_env()
    if db.ensure_database(dsn):
        print(f"created database {db.database_name(dsn)}")
    with db.connection(dsn) as conn:
        applied = db.migrate(conn)
        print(f"migrations applied: {', '.join(applied) if applied else 'none (up to date)'}")
        names = [args.pipeline] if args.pipeline else sorted(PIPELINES)
        for name in names:
            from onceflow.pipeline import get_pipeline
            from onceflow.stateful import check_state_config

            pipeline = get_pipeline(name)
            instance = register(conn, pipeline, create_topic=True)
            check_state_config(pipeline, dsn)
            print(f"pipeline {name} ready (instance {instance})")
    return 0


def cmd_produce(args) -> int:
    from onceflow.examples.tweets import generate
    from onceflow.source import produce

    pipeline = _pipeline(args)
    events = generate(args.events, seed=args.seed, malformed_share=args.malformed_share,
                      poison_share=args.poison_share, flaky_share=args.flaky_share,
                      start_id=args.start_id)
    with db.connection() as conn:
        started = time.monotonic()
        if pipeline.source == "files":
            from onceflow.segments import produce_segments

            n = produce_segments(conn, pipeline.segments_root(), pipeline.topic, events)
        else:
            n = produce(conn, pipeline.topic, events)
        took = time.monotonic() - started
    print(f"produced {n} events to topic {pipeline.topic} in {took:.1f}s "
          f"(seed {args.seed}, malformed share {args.malformed_share}, poison share "
          f"{args.poison_share}, flaky share {args.flaky_share})")
    return 0


def cmd_status(args) -> int:
    from onceflow.backflow import dead_letter_lines, queue_sizes
    from onceflow.status import commit_log, gap_lines, partition_lines

    with db.connection() as conn:
        with conn.cursor() as cur:
            print(f"transactions of {args.pipeline} (commit order):")
            for line in commit_log(cur, args.pipeline, args.limit):
                print("  " + line)
            print("partitions:")
            for line in partition_lines(cur, args.pipeline):
                print("  " + line)
            gaps = gap_lines(cur, args.pipeline)
            print("gaps (records gone before they were read):" + ("" if gaps else " none"))
            for line in gaps:
                print("  " + line)
            print(queue_sizes(cur, args.pipeline).line())
            for line in dead_letter_lines(cur, args.pipeline, args.limit):
                print("  " + line)
    return 0


def cmd_replay_dead_letters(args) -> int:
    from onceflow.backflow import replay_dead_letters
    from onceflow.coordinator import lock_pipeline
    from onceflow.db import transaction

    positions = None
    if args.record:
        positions = []
        for item in args.record:
            partition, _, offset = item.partition(":")
            if not (partition.isdigit() and offset.isdigit()):
                raise ValueError(f"--record={item!r} is invalid: give PARTITION:OFFSET, "
                                 "e.g. --record 2:1041 (see `onceflow status`)")
            positions.append((int(partition), int(offset)))
    if positions is None and args.error_contains is None and not args.all:
        print("onceflow replay-dead-letters: nothing chosen: pass --record P:O (repeatable), "
              "--error-contains TEXT, or --all", file=sys.stderr)
        return 2
    with db.connection() as conn, transaction(conn) as cur:
        lock_pipeline(cur, args.pipeline)
        n = replay_dead_letters(cur, args.pipeline, positions=positions,
                                error_contains=args.error_contains)
    print(f"put {n} dead letter(s) of {args.pipeline} back in the backflow from-queue: the "
          "next transactions replay them")
    return 0


def cmd_verify(args) -> int:
    from onceflow.verify import verify

    with db.connection() as conn:
        report = verify(conn, _pipeline(args))
    for mismatch in report.mismatches:
        print("  " + mismatch)
    print(report.line())
    return 0 if report.ok else 1


def _embedded_env() -> str:
    """Find or start PostgreSQL, set up the Airflow environment. Returns the DSN."""
    from onceflow.localenv import airflow_db_ready, airflow_env, apply_env, project_dir
    from onceflow.localpg import ensure_postgres

    root = project_dir()
    dsn, how = ensure_postgres(root)
    print(f"onceflow: PostgreSQL: using {how}")
    apply_env(airflow_env(root, dsn))
    airflow_db_ready(root)
    return os.environ["ONCEFLOW_PG_DSN"]


def cmd_demo(args) -> int:
    from onceflow.demo import load_dag, run_transactions
    from onceflow.localenv import project_dir

    started = time.monotonic()
    logging.getLogger("airflow").setLevel(logging.WARNING)  # its output goes to the log file
    _embedded_env()
    pipeline = args.pipeline
    cmd_init(argparse.Namespace(pipeline=None))
    cmd_produce(args)
    dag = load_dag(project_dir() / "dags", dag_id=f"onceflow_{pipeline}")
    log_file = project_dir() / ".run" / "demo.log"
    print(f"running {args.transactions} transaction(s) through the Airflow DAG {dag.dag_id} "
          f"(Airflow and Spark output: {log_file})")
    results = run_transactions(dag, args.transactions, args.batch_size, log_file)
    print()
    cmd_status(argparse.Namespace(pipeline=pipeline, limit=args.transactions + 5))
    print()
    code = cmd_verify(args)
    failed = [r for r in results if r[1] != "success"]
    if failed:
        print(f"{len(failed)} DAG run(s) failed: see the task logs under .airflow/logs")
        code = 1
    print(f"demo finished in {time.monotonic() - started:.1f}s")
    return code


def cmd_reset(args) -> int:
    from onceflow.coordinator import reset_offsets

    if not args.force_from_start:
        print("onceflow reset: nothing done: pass --force-from-start to forget the committed "
              "offsets (records are read again and counted again)", file=sys.stderr)
        return 2
    with db.connection() as conn:
        instance = reset_offsets(conn, _pipeline(args))
    print(f"pipeline {args.pipeline}: offsets forgotten, new instance {instance}")
    return 0


def cmd_retention(args) -> int:
    from onceflow.retention import delete_before

    with db.connection() as conn:
        n = delete_before(conn, args.topic, args.before, args.partition)
    where = f"partition {args.partition}" if args.partition is not None else "every partition"
    print(f"deleted {n} records of topic {args.topic} below offset {args.before} ({where})")
    return 0


def cmd_backfill(args) -> int:
    from onceflow.backfill import backfill
    from onceflow.localenv import project_dir

    if args.via == "local" and not args.dry_run:
        _embedded_env()
    with db.connection() as conn:
        def load():
            from onceflow.demo import load_dag

            return load_dag(project_dir() / "dags", dag_id=args.dag_id)

        done = backfill(conn, args.pipeline, args.dag_id, args.via, args.dry_run, load)
    return 0 if all(state in ("success", "queued") for _, _, state in done) else 1


def cmd_ui(args) -> int:
    from onceflow.localenv import project_dir

    _embedded_env()
    cmd_init(argparse.Namespace(pipeline=None))
    home = os.environ["AIRFLOW_HOME"]
    print(f"Airflow UI: http://127.0.0.1:8080  user admin, password in "
          f"{home}/simple_auth_manager_passwords.json.generated")
    print(f"DAGs folder {project_dir() / 'dags'}; stop with Ctrl-C")
    sys.stdout.flush()
    os.execvp("airflow", ["airflow", "standalone"])
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onceflow",
        description="Exactly-once batch transactions on Airflow, Spark and PostgreSQL.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    p = add("pg", cmd_pg, "find or start PostgreSQL and print its DSN")
    p.add_argument("--stop", action="store_true", help="stop the private cluster in .pgdata/")
    p = add("init", cmd_init, "create the database, apply migrations, register pipelines")
    p.add_argument("--pipeline", help="register only this pipeline (default: all)")
    for name, func, text in (("produce", cmd_produce, "append seeded demo tweets to the source"),
                             ("demo", cmd_demo, "run the demo pipeline end to end")):
        p = add(name, func, text)
        p.add_argument("--pipeline", default="tweets",
                       help="pipeline whose source gets the events: tweets (PostgreSQL log) or "
                            "tweets_files (Parquet segments); the demo runs its DAG")
        p.add_argument("--events", type=int, default=60_000, help="how many events (60000)")
        p.add_argument("--seed", type=int, default=42, help="random seed (42)")
        p.add_argument("--malformed-share", type=float, default=0.02,
                       help="share of malformed payloads, 0..1 (0.02)")
        p.add_argument("--poison-share", type=float, default=0.0005,
                       help="share of tweets whose host the domain bolt refuses: they fail "
                            "every try and end in the dead letters (0.0005)")
        p.add_argument("--flaky-share", type=float, default=0.001,
                       help="share of tweets whose lookup fails their first 1-2 tries, then "
                            "succeeds on replay (0.001)")
        p.add_argument("--start-id", type=int, default=0, help="first tweet id (0)")
        if name == "demo":
            p.add_argument("--transactions", type=int, default=3, help="DAG runs (3)")
            p.add_argument("--batch-size", type=int, default=20_000,
                           help="records per transaction (20000)")
    p = add("status", cmd_status, "show transactions in commit order, partition offsets, "
            "backflow queues and dead letters")
    p.add_argument("--pipeline", default="tweets")
    p.add_argument("--limit", type=int, default=50, help="last N transactions (50)")
    p = add("verify", cmd_verify,
            "recompute the expected state from the source and compare with the committed state")
    p.add_argument("--pipeline", default="tweets")
    p = add("reset", cmd_reset,
            "forget a pipeline's committed offsets: partitions start again by start_policy")
    p.add_argument("--pipeline", default="tweets")
    p.add_argument("--force-from-start", action="store_true", help="yes, really")
    p = add("retention", cmd_retention,
            "delete a topic's records below an offset (the source log's retention)")
    p.add_argument("--topic", default="tweets")
    p.add_argument("--before", type=int, required=True, help="first offset to keep")
    p.add_argument("--partition", type=int, help="only this partition (default: all)")
    p = add("backfill", cmd_backfill,
            "re-run failed and superseded transactions in txid order (DAG runs with conf txid)")
    p.add_argument("--pipeline", default="tweets")
    p.add_argument("--dag-id", default="onceflow_tweets", help="the pipeline's DAG")
    p.add_argument("--via", choices=("airflow", "local"), default="airflow",
                   help="airflow: queue runs for the scheduler (airflow dags trigger); "
                        "local: run them here one by one with dag.test() (default airflow)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be re-run")
    p = add("replay-dead-letters", cmd_replay_dead_letters,
            "put chosen dead letters back in the backflow queue (after fixing their cause)")
    p.add_argument("--pipeline", default="tweets")
    p.add_argument("--record", action="append", metavar="P:O",
                   help="the dead letter at partition P, offset O (repeatable)")
    p.add_argument("--error-contains", metavar="TEXT",
                   help="the dead letters with TEXT in any of their errors")
    p.add_argument("--all", action="store_true", help="every dead letter of the pipeline")
    add("ui", cmd_ui, "start the Airflow UI (airflow standalone on 127.0.0.1:8080)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, LookupError, FileNotFoundError) as error:
        print(f"onceflow {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
