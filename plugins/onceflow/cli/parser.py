"""The `onceflow` command line: each command, its arguments and its help."""

from __future__ import annotations

import argparse

from onceflow.cli.args import non_negative, positive_float, positive_int, txid_range
from onceflow.cli.local import UI_COMPONENTS, cmd_dags, cmd_pg, cmd_spark, cmd_ui
from onceflow.cli.operate import (
    cmd_backfill,
    cmd_init,
    cmd_pipelines,
    cmd_release,
    cmd_repair,
    cmd_replay_dead_letters,
    cmd_reset,
    cmd_retention,
    cmd_status,
    cmd_verify,
)
from onceflow.cli.records import cmd_import, cmd_produce

EPILOG = """\
Pipelines are found by entry point (group onceflow.pipelines) and by module:attribute
references in ONCEFLOW_PIPELINES or --pipelines.
PostgreSQL: ONCEFLOW_PG_DSN (default postgresql://postgres@127.0.0.1:5432/onceflow); in
onceflow's checkout, `onceflow pg` finds or starts a local one. `onceflow COMMAND --help`
explains each command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onceflow",
        description="Exactly-once batch transactions on Airflow, Spark and PostgreSQL.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--pipelines", action="append", metavar="MODULE:ATTR",
                        help="also load pipelines from this reference (repeatable)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text, pipeline: bool = True):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        if pipeline:
            p.add_argument("--pipeline", metavar="NAME",
                           help="the pipeline (default: the only registered one)")
        return p

    p = add("pg", cmd_pg, "find or start PostgreSQL and print its DSN (onceflow's checkout "
            "only: its demo and tests)", pipeline=False)
    p.add_argument("--stop", action="store_true", help="stop the private cluster in .pgdata/")
    add("init", cmd_init, "create the database, apply migrations, register pipelines and "
        "create their sources (default: every registered pipeline)")
    add("pipelines", cmd_pipelines, "list the registered pipelines and where they come from",
        pipeline=False)
    add("dags", cmd_dags, "print the DAG file that gives every registered pipeline its DAG: "
        "onceflow dags > $AIRFLOW_HOME/dags/onceflow_pipelines.py", pipeline=False)
    p = add("produce", cmd_produce, "append records (one payload per line) to a pipeline's "
            "source, when onceflow keeps it (PostgreSQL log, file segments)")
    p.add_argument("--file", default="-", metavar="FILE",
                   help="read payloads from FILE, one per line (default: standard input)")
    p.add_argument("--chunk", type=positive_int, default=None, metavar="N",
                   help="records per write (one PostgreSQL transaction) at most (default "
                        "100,000 from standard input, the source's own from a file)")
    p.add_argument("--flush-s", type=positive_float, default=1.0, metavar="S",
                   help="from standard input: write what has come at most S seconds after "
                        "its first record arrived, full chunk or not (default 1)")
    p = add("import", cmd_import, "import records that have their partition and offset "
            "already (Parquet or JSON-lines files with partition, offset, payload: e.g. a Kafka "
            "export) into a file-segment source, keeping both; a second import of the same "
            "files changes nothing; records at offsets the log holds with another payload "
            "refuse the whole import (exit 2) unless --on-conflict keep-existing")
    p.add_argument("files", nargs="+", metavar="FILE", help="the files to import")
    p.add_argument("--on-conflict", choices=("refuse", "keep-existing"), default="refuse",
                   help="records at offsets the log already holds with another payload (or "
                        "below a partition's log start): refuse the whole import (default), "
                        "or keep the log's records and import only the new ones past each "
                        "head. There is no replace: batches may have read those offsets")
    p = add("status", cmd_status, "transactions in commit order, what holds up open ones, "
            "partition offsets and lag, gaps, backflow queues, dead letters, damaged "
            "bookkeeping. Exit 1 when the pipeline is stalled: an open txid failed, "
            "superseded, abandoned by its run or behind one that needs a fix, a source file "
            "that needs `onceflow repair`, or damaged bookkeeping; 0 when transactions are "
            "only in flight")
    p.add_argument("--limit", type=positive_int, default=20, help="last N transactions (20)")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.add_argument("--all", action="store_true", help="list every dead letter")
    p = add("verify", cmd_verify, "check the committed state: re-run the topology over every "
            "committed batch and compare (exit 1 on a mismatch, 3 when no mismatch but a txid "
            "could not be re-read); --txids or --last re-run only some (what each proves: "
            "docs/import-verify-repair.md)")
    p.add_argument("--recount", action="store_true",
                   help="compare with the pipeline's own recount function instead")
    p.add_argument("--txids", type=txid_range, metavar="A..B",
                   help="re-run only txids A to B: what they added, the keys they last "
                        "wrote, and the state tables against every commit's record")
    p.add_argument("--last", type=positive_int, metavar="N",
                   help="re-run only the newest N committed txids (as --txids)")
    p = add("reset", cmd_reset,
            "forget a pipeline's committed offsets: partitions start again by start_policy")
    p.add_argument("--force-from-start", action="store_true", help="yes, really")
    p = add("retention", cmd_retention, "delete a topic's records below an offset, only what "
            "every pipeline has committed unless --force", pipeline=False)
    p.add_argument("--topic", required=True, help="the topic")
    p.add_argument("--before", type=non_negative, required=True,
                   help="first offset to keep")
    p.add_argument("--partition", type=non_negative, help="only this partition (default: all)")
    p.add_argument("--force", action="store_true",
                   help="also delete records a pipeline has not read (recorded as gaps)")
    p.add_argument("--dry-run", action="store_true", help="only say what would go")
    p = add("backfill", cmd_backfill, "re-run failed, superseded and abandoned transactions "
            "in txid order (DAG runs with conf txid)")
    p.add_argument("--dag-id", help="the pipeline's DAG (default onceflow_<pipeline>)")
    p.add_argument("--via", choices=("airflow", "local"), default="airflow",
                   help="airflow: queue runs for the scheduler (airflow dags trigger); "
                        "local: run them here one by one with dag.test(), in onceflow's "
                        "checkout (default airflow)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be re-run")
    p = add("replay-dead-letters", cmd_replay_dead_letters,
            "put chosen dead letters back in the backflow queue (after fixing their cause)")
    p.add_argument("--record", action="append", metavar="P:O",
                   help="the dead letter at partition P, offset O (repeatable)")
    p.add_argument("--error-contains", metavar="TEXT",
                   help="the dead letters with TEXT in any of their errors")
    p.add_argument("--all", action="store_true", help="every dead letter of the pipeline")
    p.add_argument("--force", action="store_true",
                   help="also for a pipeline with dead_letter_approval: replay without the "
                        "approval its DAG asks for (logged, with who)")
    p.add_argument("--by", metavar="NAME",
                   help="who replays, for the log (default: your OS user)")
    p = add("repair", cmd_repair, "find what a crash (or a hand in the database) left "
            "inconsistent (commit records, partition offsets, committed ranges, the "
            "coordinator row, abandoned attempts, stale staging and claims), and landed files "
            "that changed after they were indexed, and say what would fix them; --yes fixes "
            "what is safe to fix, --accept-changed or --skip-changed each changed file (exit 1 "
            "while something is left wrong)")
    p.add_argument("--yes", action="store_true", help="do the repairs")
    p.add_argument("--accept-changed", action="append", metavar="FILE",
                   help="a changed landed file (as repair lists it): index it again as it is "
                        "now, when no pipeline planned its changed part (repeatable)")
    p.add_argument("--skip-changed", action="append", metavar="FILE",
                   help="a changed landed file: skip its records no pipeline committed, "
                        "recorded as gaps, and stop following it (repeatable)")
    p = add("release", cmd_release, "free a planned txid whose run is dead, now: its attempt is "
            "fenced and the next run adopts the txid (refused while a task of it reports, "
            "unless --force)")
    p.add_argument("--txid", type=positive_int, required=True, help="the planned txid")
    p.add_argument("--force", action="store_true",
                   help="also when its holder reported within the lease (its writes are then "
                        "refused)")
    p = add("spark", cmd_spark, "start, stop or check the local Spark Connect server (the warm "
            "Spark processing tasks use in local mode); jar: print the path of onceflow's JVM "
            "reader (built with the package), for a Spark onceflow does not start",
            pipeline=False)
    p.add_argument("action", choices=("start", "stop", "status", "jar"))
    p.add_argument("--port", type=positive_int, default=None,
                   help="its port (default ONCEFLOW_SPARK_CONNECT_PORT or 15002)")
    p = add("ui", cmd_ui, "start the Airflow UI (airflow standalone on 127.0.0.1:8080) with "
            "the embedded defaults (onceflow's checkout only: `bash run.sh ui`)",
            pipeline=False)
    p.add_argument("--port", type=positive_int, default=None,
                   help="the API server's port (default AIRFLOW__API__PORT or 8080); it must "
                        "be free")
    p.add_argument("--only", choices=UI_COMPONENTS, default=None,
                   help="start this one component alone, with the same settings (to restart "
                        "one that stopped while the others run)")
    return parser
