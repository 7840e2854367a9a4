"""`orders-demo`: the orders example end to end on embedded defaults (what
`bash run.sh demo orders` runs).

``--variant table`` (the default): the ``orders`` table in PostgreSQL, written by concurrent
writers that hold their transactions open a random while (out-of-order commits) during the
runs of the pipeline's Airflow DAG; then more runs until a batch reads nothing new.
``--variant files``: Parquet files landed in the landing folder (ORDERS_LANDING, default
.run/landing/orders) between the runs, each written under a temporary name first.

Then the committed tables are compared with what plain SQL (or Python over the files) says
they must be, and `onceflow verify --recount` runs. Exit status 1 when a check fails or a run
fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path

from onceflow.cli import positive_int, run_command
from orders_example import data


def _setup(name: str):
    from onceflow.core import db
    from onceflow.core.registration import register
    from onceflow.core.registry import get_pipeline
    from onceflow.dev.demo import prepare_dag_test
    from onceflow.dev.localenv import embedded_env

    # Airflow's in-process API is built while the Spark server starts (run_transactions
    # waits for the server)
    dsn = embedded_env(wait_spark=False)
    prepare_dag_test()
    db.ensure_database(dsn)
    conn = db.connect(dsn)
    db.migrate(conn)
    pipeline = get_pipeline(name)
    if name == "orders":
        data.create_table(conn)
    else:
        Path(pipeline.source.path).mkdir(parents=True, exist_ok=True)
    register(conn, pipeline, create_source=True)
    return dsn, conn, pipeline


def _last_batch(conn, pipeline) -> tuple[int, int]:
    with conn.cursor() as cur:
        cur.execute("""SELECT records, replayed FROM transactions WHERE pipeline = %s
                       ORDER BY txid DESC LIMIT 1""", (pipeline.name,))
        row = cur.fetchone()
    conn.commit()
    return row or (0, 0)


def _expected_from_files(folder: Path) -> data.Expected:
    import pyarrow.parquet as pq

    orders = []
    for path in sorted(folder.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            orders.append(data.Order(row["merchant"], row["amount"], row["ordered_at"],
                                     row["order_id"]))
    return data.expected_from_rows(orders)


def run(args) -> int:
    from onceflow.dev.demo import load_dag, run_transactions
    from onceflow.dev.localenv import project_dir
    from onceflow.ops.verify import recount

    started = time.monotonic()
    logging.getLogger("airflow").setLevel(logging.WARNING)
    name = "orders" if args.variant == "table" else "orders_files"
    dsn, conn, pipeline = _setup(name)
    dag = load_dag(project_dir() / "dags", f"onceflow_{name}")
    log_file = project_dir() / ".run" / "demo.log"
    conf = {"batch_size": args.batch_size}
    results = []
    try:
        if args.variant == "table":
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM public.orders")
                seed = cur.fetchone()[0]
            conn.commit()
            orders = list(data.generate(args.orders, seed=seed))
            writers = data.Writers(dsn, orders, writers=args.writers).start()
            print(f"{args.writers} writers are inserting {args.orders} orders into "
                  "public.orders (transactions held open a while: out-of-order commits); "
                  f"running the DAG {dag.dag_id} meanwhile (output: {log_file})")
            while writers.running:
                results += run_transactions(dag, 1, conf, log_file)
            writers.join()
        else:
            folder = Path(pipeline.source.path)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            first = sum(1 for _ in folder.glob("*.parquet")) * 10**6 + 1
            orders = list(data.generate(args.orders, seed=first, start_id=first))
            step = max(1, args.orders // args.files)
            print(f"landing {args.orders} orders in {args.files} Parquet files into {folder}, "
                  f"running the DAG {dag.dag_id} between them (output: {log_file})")
            for i in range(0, args.orders, step):
                data.land_parquet(folder, orders[i:i + step], f"orders-{stamp}-{i:08d}.parquet")
                time.sleep(pipeline.source.settle_s)
                results += run_transactions(dag, 1, conf, log_file)
        for _ in range(args.max_runs):  # until a batch reads nothing new
            results += run_transactions(dag, 1, conf, log_file)
            if _last_batch(conn, pipeline) == (0, 0):
                break
        want = (data.expected_from_table(conn) if args.variant == "table"
                else _expected_from_files(Path(pipeline.source.path)))
        got = data.committed(conn, prefix="" if args.variant == "table" else "files_")
        problems = data.differences(want, got)
        report = recount(conn, pipeline)
    finally:
        conn.close()
    print(f"\n{want.orders} orders: {len(got.revenue)} (merchant, day) revenue rows, "
          f"{sum(got.large.values())} large orders, {len(got.last_order)} merchants' last "
          f"orders, {got.refunds} refunds rejected")
    total = sum(r for r, _, _ in got.revenue.values())
    print(f"revenue committed {total}, from the orders themselves "
          f"{sum(r for r, _, _ in want.revenue.values())}")
    for problem in problems + report.mismatches:
        print("  MISMATCH " + problem)
    print(report.line())
    failed = [r for r in results if r[1] != "success"]
    if failed:
        print(f"{len(failed)} DAG run(s) failed: see the task logs under .airflow/logs")
    print(f"orders demo finished in {time.monotonic() - started:.1f}s")
    return 0 if not problems and report.ok and not failed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orders-demo",
        description="onceflow's orders example end to end: typed state, an append and an "
                    "upsert table, from a PostgreSQL table written concurrently or from "
                    "Parquet files.")
    parser.add_argument("--variant", choices=("table", "files"), default="table",
                        help="read the orders table (table) or Parquet files (files)")
    parser.add_argument("--orders", type=positive_int, default=20_000,
                        help="orders to write (20000)")
    parser.add_argument("--writers", type=positive_int, default=4,
                        help="concurrent writers of the table variant (4)")
    parser.add_argument("--files", type=positive_int, default=4,
                        help="Parquet files of the files variant (4)")
    parser.add_argument("--batch-size", type=positive_int, default=10_000,
                        help="key values (table) or records (files) per transaction (10000)")
    parser.add_argument("--max-runs", type=positive_int, default=10,
                        help="runs after the writing, until one reads nothing new (10)")
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_command("orders-demo", args.func, args)
    finally:
        gc.freeze()  # skips the exit's last collection of Airflow's objects (tweets_example)


if __name__ == "__main__":
    sys.exit(main())
