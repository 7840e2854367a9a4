"""spark-submit entry point of the processing phase.

    spark-submit spark_tasks/process_batch.py --pipeline page_views --txid 7 --attempt 1 \
        [--group 0] [--pipelines my_company.pipelines:PIPELINES]

The pipeline is found like everywhere else (onceflow.core.registry): an installed entry point,
ONCEFLOW_PIPELINES, or the ``--pipelines`` reference the Airflow task passes along. The
PostgreSQL DSN comes from the environment (ONCEFLOW_PG_DSN by default), never from the command
line, where it would show in process lists and logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from onceflow.core import settings
from onceflow.core.errors import Permanent
from onceflow.core.registry import get_pipeline
from onceflow.core.txlog import TransactionAttempt
from onceflow.spark.processing import process_batch
from onceflow.spark.session import get_spark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="process_batch",
        description="Process one transaction attempt of a onceflow pipeline and stage its result.",
    )
    parser.add_argument("--pipeline", required=True, help="registered pipeline name")
    parser.add_argument("--pipelines", action="append", default=[], metavar="MODULE:ATTR",
                        help="where to find the pipeline besides entry points and "
                             "ONCEFLOW_PIPELINES (repeatable)")
    parser.add_argument("--txid", type=int, required=True, help="transaction id planned by begin")
    parser.add_argument("--attempt", type=int, required=True, help="the attempt being processed")
    parser.add_argument("--group", type=int, default=0, help="processing group (default 0)")
    parser.add_argument("--dsn-env", default=settings.env_name("pg_dsn"),
                        help="environment variable holding the PostgreSQL DSN "
                             "(default %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dsn = (settings.get("pg_dsn") if args.dsn_env == settings.env_name("pg_dsn")
           else os.environ.get(args.dsn_env))
    if not dsn:
        print(f"error: environment variable {args.dsn_env} is not set: export the PostgreSQL DSN "
              "there (the Airflow operator does this from its connection)", file=sys.stderr)
        return 2
    try:
        pipeline = get_pipeline(args.pipeline, args.pipelines)
    except Permanent as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    spark = get_spark(app_name=f"onceflow-{pipeline.name}-txid{args.txid}")
    try:
        process_batch(spark, dsn, pipeline, TransactionAttempt(args.txid, args.attempt), args.group)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
