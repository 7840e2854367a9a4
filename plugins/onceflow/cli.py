"""The `onceflow` command.

Exit codes: 0 done; 1 a failure (verify found a mismatch, a run failed, status found the
pipeline stalled); 2 a usage or configuration error (a bad argument, an unknown or invalid
pipeline, a database that does not answer), always with one line saying what to change; 3
(verify) no mismatch, but a txid could not be re-read.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import queue
import re
import sys
import threading
import time

from onceflow.airflow.backfill import starter
from onceflow.core import db, settings, txlog
from onceflow.core.backflow import replay_dead_letters
from onceflow.core.db import transaction
from onceflow.core.errors import ConfigError, OnceflowError, Permanent, SharedTable, Unavailable
from onceflow.core.registration import external_dsns, register, reset_offsets
from onceflow.core.registry import get_pipeline, invalid_pipelines, pipelines
from onceflow.core.txlog import TxState
from onceflow.kvstate import check_state_config
from onceflow.ops import retention, verify
from onceflow.ops.backfill import backfill
from onceflow.ops.repair import repair
from onceflow.ops.status import pipeline_status, release_command, render
from onceflow.sources import catalog
from onceflow.sources.jvm import ENABLED, JAR, built_for, installed_spark, unusable
from onceflow.sources.pglog import PostgresLog, check_payload
from onceflow.sources.segments import FileSegments, import_segments, read_export
from onceflow.spark import localspark

log = logging.getLogger("onceflow.cli")
STDIN_CHUNK = 100_000  # records written at once from standard input at most

EPILOG = """\
Pipelines are found by entry point (group onceflow.pipelines) and by module:attribute
references in ONCEFLOW_PIPELINES or --pipelines.
PostgreSQL: ONCEFLOW_PG_DSN (default postgresql://postgres@127.0.0.1:5432/onceflow); in
onceflow's checkout, `onceflow pg` finds or starts a local one. `onceflow COMMAND --help`
explains each command.
"""


class Progress:
    """Progress of long work: a live line on a terminal, plain lines otherwise."""

    def __init__(self, what: str) -> None:
        self.what, self.started = what, time.monotonic()
        self.tty = sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        line = f"{self.what}: {text} ({elapsed:.1f}s)"
        if self.tty:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


# -- arguments ------------------------------------------------------------------------------------
def _refs(args) -> tuple[str, ...]:
    return tuple(getattr(args, "pipelines", None) or ())


def _known(args) -> dict:
    return pipelines(_refs(args))


def _pipeline(args):
    """The pipeline --pipeline names; without it, the only registered one."""

    name = getattr(args, "pipeline", None)
    if name is None:
        known = _known(args)
        invalid = invalid_pipelines(_refs(args))
        if len(known) + len(invalid) == 1 and invalid:
            raise ConfigError(next(iter(invalid.values())).message())
        if len(known) + len(invalid) != 1:
            known = {**known, **invalid}
            raise ConfigError(
                "--pipeline is needed: " + (f"choose one of {', '.join(sorted(known))}" if known
                                            else "no pipeline is registered (entry point "
                                                 "onceflow.pipelines, ONCEFLOW_PIPELINES or "
                                                 "--pipelines MODULE:ATTR)"))
        return next(iter(known.values()))
    return get_pipeline(name, _refs(args))


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0: give 1 or more")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: give more than 0 seconds")
    return value


def txid_range(text: str) -> tuple[int, int]:
    """An argparse type: ``A..B`` (or one txid ``N``, read as N..N), 1 <= A <= B."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a txid range: give A..B (e.g. "
                                         "2..5) or one txid")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if first < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: txids start at 1: give 1..{max(1, last)}"
                                         " or higher")
    if first > last:
        raise argparse.ArgumentTypeError(f"{text!r} ends before it starts: give A..B with "
                                         f"A <= B ({last}..{first})")
    return first, last


def _checkout(module: str, what: str, instead: str):
    """``onceflow.dev.<module>``: the helpers of onceflow's checkout (a local PostgreSQL, its
    Airflow environment, the demo's DAG runner), importable in the checkout's editable
    install only; the package has none of them. Without them: a ConfigError saying ``what``
    needs the checkout, and ``instead``."""

    try:
        return importlib.import_module(f"onceflow.dev.{module}")
    except ModuleNotFoundError as error:
        if error.name not in ("onceflow.dev", f"onceflow.dev.{module}"):
            raise
        raise ConfigError(f"{what} is a development command of onceflow's checkout (run it "
                          f"there through run.sh); this onceflow is installed as a package. "
                          f"{instead}") from None


# -- commands -------------------------------------------------------------------------------------
def cmd_pg(args) -> int:
    localpg = _checkout(
        "localpg", "`onceflow pg` (find or start a throwaway PostgreSQL for the demo and the "
        "tests)", "Point onceflow at your PostgreSQL with ONCEFLOW_PG_DSN, e.g. "
        "postgresql://user@host:5432/onceflow, then `onceflow init`")
    # imported here: onceflow.dev is the checkout's own (not in the wheel)
    from onceflow.dev import project_dir

    if args.stop:
        localpg.stop_private(localpg.private_data_dir(project_dir()))
        return 0
    dsn, how = localpg.ensure_postgres(project_dir())
    print(f"onceflow: using {how}", file=sys.stderr)
    print(dsn)
    return 0


def cmd_init(args) -> int:
    dsn = db.dsn_from_env()
    # the declarations first: pipelines that cannot load together create nothing
    chosen = [_pipeline(args)] if args.pipeline else list(_known(args).values())
    if db.ensure_database(dsn):
        print(f"created database {db.database_name(dsn)}")
    refused = 0
    with db.connection(dsn) as conn:
        applied = db.migrate(conn)
        print(f"migrations applied: {', '.join(applied) if applied else 'none (up to date)'}")
        for pipeline in chosen:
            try:  # the declaration, checked before anything of the pipeline is made
                pipeline.build_topology()
            except ConfigError as exc:
                if args.pipeline:
                    raise
                refused += 1
                print(f"pipeline {pipeline.name} not set up: {exc}", file=sys.stderr)
                continue
            try:
                instance = register(conn, pipeline, external_dsns(pipeline), create_source=True)
            except SharedTable as exc:  # another pipeline's table: refused, not postponed
                if args.pipeline:
                    raise
                conn.rollback()
                refused += 1
                print(f"pipeline {pipeline.name} not set up: {exc}", file=sys.stderr)
                continue
            except ConfigError as exc:
                if args.pipeline:
                    raise
                # one pipeline not ready (say its table does not exist yet) keeps no other
                # from being set up; its first transaction registers it once it is ready
                conn.rollback()
                print(f"pipeline {pipeline.name} skipped: {exc} (then `onceflow init "
                      f"--pipeline {pipeline.name}`)", file=sys.stderr)
                continue
            check_state_config(pipeline, dsn)
            print(f"pipeline {pipeline.name} ready ({pipeline.source.describe()}, instance "
                  f"{instance})")
    if not args.pipeline:
        for bad in invalid_pipelines(_refs(args)).values():
            refused += 1
            print(f"pipeline {bad.name} not set up: {bad.message()}", file=sys.stderr)
    if not chosen:
        print("no pipeline is registered yet: see `onceflow pipelines`")
    return 2 if refused else 0


def cmd_pipelines(args) -> int:
    """Each pipeline with its declaration checked (Pipeline.build_topology): exit 2 when
    one is refused, each refused one marked and its reason under it."""
    known, invalid = _known(args), invalid_pipelines(_refs(args))
    if not known and not invalid:
        print("no pipeline is registered: add an entry point in the group onceflow.pipelines, "
              "or set ONCEFLOW_PIPELINES=package.module:attribute (or --pipelines)")
    refused = len(invalid)
    for name, bad in sorted(invalid.items()):  # left out of every command, the others go on
        print(f"{name}: INVALID (from {bad.where}):\n    {bad.error}")
    for name, p in sorted(known.items()):
        states = ", ".join(s.table for s in p.states)
        line = (f"{name}: {p.source.describe()} -> {states} ({p.mode}, batch {p.batch_size}; "
                f"from {p.ref})")
        try:
            p.build_topology()
        except ConfigError as error:
            refused += 1
            print(f"{line} DECLARATION ERROR:\n    {error}")
        else:
            print(line)
    if refused:
        print(f"onceflow pipelines: {refused} of {len(known) + len(invalid)} pipelines have "
              "declaration errors (each is named above): fix them before their DAGs can run",
              file=sys.stderr)
        return 2
    return 0


def _lines(path: str):
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    try:
        for line in stream:
            yield line.rstrip("\n")
    finally:
        if stream is not sys.stdin:
            stream.close()


def _live_chunks(stream, size: int, flush_s: float):
    """Lists of at most ``size`` lines of ``stream`` (binary, UTF-8), each given at most
    ``flush_s`` after its first line arrived: a live producer's records are written as they
    come, not when a chunk fills. A thread reads what the pipe has (never waiting for more
    than one read), so a quiet producer never holds back the lines it already wrote."""
    lines: queue.Queue = queue.Queue(maxsize=64)
    end = object()

    def read() -> None:
        tail = b""
        try:
            while True:
                data = stream.read1(1 << 16)
                if not data:
                    break
                *whole, tail = (tail + data).split(b"\n")
                if whole:
                    lines.put([line.decode("utf-8") for line in whole])
            if tail:
                lines.put([tail.decode("utf-8")])
            lines.put(end)
        except BaseException as error:  # (bad UTF-8): raised where the chunks are read
            lines.put(error)

    threading.Thread(target=read, name="produce-stdin", daemon=True).start()
    chunk: list[str] = []
    deadline = 0.0
    while True:
        try:
            got = lines.get(timeout=max(0.0, deadline - time.monotonic()) if chunk else None)
        except queue.Empty:
            yield chunk
            chunk = []
            continue
        if got is end:
            if chunk:
                yield chunk
            return
        if isinstance(got, BaseException):
            if isinstance(got, UnicodeDecodeError):
                raise ConfigError(f"standard input is not UTF-8 text ({got.reason}): give "
                                  "one payload per line in UTF-8") from got
            raise got
        if not chunk:
            deadline = time.monotonic() + flush_s
        for line in got:
            chunk.append(line.rstrip("\r") if line.endswith("\r") else line)
            if len(chunk) >= size:
                yield chunk
                chunk = []
                deadline = time.monotonic() + flush_s


def cmd_produce(args) -> int:
    pipeline = _pipeline(args)
    if args.file != "-" and not os.path.isfile(args.file):

        raise ConfigError(f"--file={args.file!r} does not exist: give a file with one payload "
                          "per line, or - for standard input")
    progress = Progress(f"produce {pipeline.topic}")
    sizes = {"chunk_size": args.chunk} if args.chunk else {}
    with db.connection() as conn:
        started = time.monotonic()
        if args.file != "-":
            n = pipeline.source.append(conn, _lines(args.file), **sizes,
                                       progress=lambda total: progress(f"{total} records"))
        else:
            n = 0
            for chunk in _live_chunks(sys.stdin.buffer, args.chunk or STDIN_CHUNK,
                                      args.flush_s):
                for i, payload in enumerate(chunk, n + 1):  # numbered over the whole input
                    check_payload(i, payload)
                n += pipeline.source.append(conn, chunk, **sizes)
                progress(f"{n} records")
    progress.done()
    print(f"produced {n} records to {pipeline.source.describe()} in "
          f"{time.monotonic() - started:.1f}s")
    return 0


def cmd_import(args) -> int:
    pipeline = _pipeline(args)
    if not isinstance(pipeline.source, FileSegments):
        raise ConfigError(f"pipeline {pipeline.name!r} reads {pipeline.source.describe()}: "
                          "import keeps partitions and offsets into file segments only "
                          "(a pipeline with source=FileSegments(...))")
    started = time.monotonic()
    table = read_export(args.files)
    with db.connection() as conn:
        done = import_segments(conn, pipeline.source.root(), pipeline.topic, table,
                               on_conflict=args.on_conflict)
    kept = ""
    if done.kept or done.before_start:
        kept = (f"; kept the log's records (--on-conflict keep-existing): {done.kept} at "
                f"offsets it holds with another payload, {done.before_start} below a "
                "partition's log start, not imported")
    print(f"imported {done.records} records into {pipeline.source.describe()} as "
          f"{done.segments} segment file(s) in {time.monotonic() - started:.1f}s; "
          f"{done.skipped} were there already (the same payload){kept}; heads now "
          f"{done.heads}")
    return 0


def cmd_status(args) -> int:
    pipeline = _pipeline(args)
    with db.connection() as conn, conn.cursor() as cur:
        status = pipeline_status(cur, pipeline.source, pipeline.name, args.limit,
                                 all_dead=args.all,
                                 approval=bool(pipeline.dead_letter_approval),
                                 lease_s=pipeline.lease_s, watch_interval=pipeline.
                                 watch_interval if pipeline.keep_up else None)
    if args.json:
        print(status.as_json())
    else:
        print("\n".join(render(status)))
    return 1 if status.stalled else 0  # stalled (ops.status.stalls): someone must act


def cmd_verify(args) -> int:
    ranged = [f"--txids {args.txids[0]}..{args.txids[1]}" if args.txids else None,
              f"--last {args.last}" if args.last is not None else None]
    ranged = [flag for flag in ranged if flag]
    if len(ranged) == 2:
        raise ConfigError(f"{ranged[0]} and {ranged[1]} both given: give one (--txids A..B "
                          "re-runs txids A to B, --last N the newest N)")
    if ranged and args.recount:
        raise ConfigError(f"--recount counts every record below the committed offsets and "
                          f"takes no {ranged[0]}: drop {ranged[0].split()[0]}, or drop "
                          "--recount to re-run those txids")
    pipeline = _pipeline(args)
    dsn = db.dsn_from_env()
    with db.connection(dsn) as conn:
        if args.recount:
            report = verify.recount(conn, pipeline, external_dsns(pipeline))
        else:
            # imported here: pyspark loads with it: only where Spark is used
            from onceflow.spark.session import get_spark

            with db.transaction(conn) as cur:  # a bad range is refused before Spark starts
                span = verify.resolve_range(cur, pipeline.name, txids=args.txids,
                                            last=args.last)
            progress = Progress(f"verify {pipeline.name}")
            if args.last is not None and span[1] - span[0] + 1 < args.last:
                progress(f"--last {args.last}: only {span[1] - span[0] + 1} committed "
                         f"txid(s): re-running txids {span[0]}..{span[1]}")
            progress("starting Spark")
            spark = get_spark("onceflow-verify")
            report = verify.rerun(conn, dsn, pipeline, spark,
                                  state_dsns=external_dsns(pipeline), progress=progress,
                                  txids=span)
            progress.done()
    for txid, why in sorted(report.unreadable.items()):
        print(f"  txid {txid} could not be re-read: {why}")
    for line in report.mismatches + [f"note: {note}" for note in report.notes]:
        print("  " + line)
    print(report.line())
    # 3: nothing mismatched in what could be read, but some txid could not be checked
    return 1 if report.found or report.mismatches else 3 if report.unreadable else 0


def cmd_reset(args) -> int:
    pipeline = _pipeline(args)
    if not args.force_from_start:
        print("onceflow reset: nothing done: pass --force-from-start to forget the committed "
              "offsets (records are read again and counted again)", file=sys.stderr)
        return 2
    with db.connection() as conn:
        instance = reset_offsets(conn, pipeline)
    print(f"pipeline {pipeline.name}: offsets forgotten, new instance {instance}")
    return 0


def _source_of_topic(args, topic: str):
    for p in _known(args).values():
        if p.topic == topic:
            return p.source
    with db.connection() as conn, conn.cursor() as cur:
        topics = catalog.topics(cur)
    if topic not in topics:
        raise ConfigError(f"--topic={topic!r} is unknown: known topics are "
                          f"{', '.join(topics) or 'none'}")
    return PostgresLog(topic=topic)


def cmd_retention(args) -> int:
    source = _source_of_topic(args, args.topic)
    by_name = {p.name: p for p in _known(args).values()}
    with db.connection() as conn:
        plan = retention.apply(conn, source, args.before, partition=args.partition,
                               force=args.force, dry_run=args.dry_run, pipelines=by_name)
    print("\n".join(plan.lines()))
    if args.dry_run:
        print(f"dry run: nothing deleted ({plan.deletes} records would go)")
    else:
        print(f"deleted {plan.deletes} records of topic {source.topic}")
    return 0


def cmd_backfill(args) -> int:
    pipeline = _pipeline(args)
    dag_id = args.dag_id or f"onceflow_{pipeline.name}"
    load = None
    if args.via == "local" and not args.dry_run:
        instead = ("Backfill with --via airflow (the default): the runs are queued for your "
                   "Airflow's scheduler")
        demo = _checkout("demo", "`onceflow backfill --via local` (DAG runs here with "
                         "dag.test(), from the checkout's dags/ folder)", instead)
        localenv = _checkout("localenv", "`onceflow backfill --via local`", instead)
        localenv.embedded_env()

        def load():
            return demo.load_dag(localenv.project_dir() / "dags", dag_id)
    with db.connection() as conn:
        done = backfill(conn, pipeline.name, starter(args.via, dag_id, load), args.dry_run)
    return 0 if all(state in ("success", "queued") for _, _, state in done) else 1


def cmd_replay_dead_letters(args) -> int:
    pipeline = _pipeline(args)
    positions = None
    if args.record:
        positions = []
        for item in args.record:
            partition, _, offset = item.partition(":")
            if not (partition.isdigit() and offset.isdigit()):
                raise ConfigError(f"--record={item!r} is invalid: give PARTITION:OFFSET, "
                                  "e.g. --record 2:1041 (see `onceflow status`)")
            positions.append((int(partition), int(offset)))
    if positions is None and args.error_contains is None and not args.all:
        raise ConfigError("nothing chosen: pass --record P:O (repeatable), --error-contains "
                          "TEXT, or --all")
    approval = f"onceflow_{pipeline.name}_replay_dead_letters"
    if pipeline.dead_letter_approval and not args.force:
        raise ConfigError(
            f"pipeline {pipeline.name!r} replays dead letters only after a person approves "
            f"(dead_letter_approval=True): ask for an approval with a run of the DAG "
            f"{approval} (the onceflow view's buttons trigger it), or pass --force to replay "
            "without one (logged with who: --by NAME, else your OS user)")
    who = args.by or _os_user()
    with db.connection() as conn, transaction(conn) as cur:
        txlog.lock_pipeline(cur, pipeline.name)
        n = replay_dead_letters(cur, pipeline.name, positions=positions,
                                error_contains=args.error_contains)
    if pipeline.dead_letter_approval:
        log.warning("REPLAY pipeline=%s: %d dead letter(s) put back WITHOUT approval "
                    "(--force, by %s; dead_letter_approval asks for %s)", pipeline.name, n,
                    who, approval)
    else:
        log.info("REPLAY pipeline=%s: %d dead letter(s) put back by %s", pipeline.name, n, who)
    print(f"put {n} dead letter(s) of {pipeline.name} back in the backflow from-queue: the "
          "next transactions replay them")
    return 0


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return f"uid {os.getuid()}"


def cmd_repair(args) -> int:
    pipeline = _pipeline(args)
    with db.connection() as conn:
        report = repair(conn, pipeline, apply=args.yes, accept_changed=args.accept_changed or (),
                        skip_changed=args.skip_changed or ())
    print("\n".join(report.lines()))
    return 0 if report.ok and not report.unresolved else 1


def cmd_release(args) -> int:
    pipeline = _pipeline(args)
    fresh = pipeline.lease_s
    reason = (f"released by `onceflow release{' --force' if args.force else ''}` "
              f"(its holder silent past {fresh}s)")
    with db.connection() as conn, transaction(conn) as cur:
        found = txlog.release(cur, pipeline.name, args.txid, fresh_s=fresh, force=args.force,
                              reason=reason)
    ta = f"txid {args.txid} attempt {found.attempt}"
    holder = found.holder or "holder unknown"
    if found.released:
        print(f"released {ta} of {pipeline.name} (run {found.run_id}, {holder}, silent "
              f"{found.silent_s:.0f}s): that attempt is fenced and the txid is failed; the "
              f"next run adopts it, now: onceflow backfill --pipeline {pipeline.name}")
        return 0
    if found.state is not TxState.PLANNED:
        raise Permanent(f"txid {args.txid} of {pipeline.name} is {found.state}, not planned: "
                          "nothing holds it" + (" (the next run adopts it)"
                                                if found.state in txlog.ADOPTABLE else ""))
    raise Permanent(
        f"{ta} of {pipeline.name} is held by run {found.run_id} "
        f"({holder}), which reported {found.silent_s:.0f}s ago, "
        f"within the {fresh}s lease: a task of it is running. Wait for it, or, if you know "
        f"that run is dead, `{release_command(pipeline.name, args.txid)} --force` (its "
        "writes are then refused)")


def cmd_spark(args) -> int:
    args.port = args.port or localspark.DEFAULT_PORT
    if args.action == "start":
        print(f"starting a Spark Connect server on 127.0.0.1:{args.port}...", file=sys.stderr)
        print(localspark.start(args.port, warm=True).line())
    elif args.action == "stop":
        stopped = localspark.stop(args.port)
        print("stopped" if stopped else "not running")
    elif args.action == "jar":

        problem = unusable(installed_spark())
        if problem is not None:
            raise ConfigError(problem)
        print(JAR)
        print(f"built for Spark {built_for()}; for a Spark it serves that onceflow does "
              f"not start (your Connect server, a cluster): --jars {JAR} --conf "
              f"{ENABLED}=true", file=sys.stderr)
    else:
        current = localspark.status(args.port)
        print(current.line())
        return 0 if current.running else 1
    return 0


def cmd_dags(args) -> int:
    from onceflow.airflow.dag_file import TEXT

    sys.stdout.write(TEXT)
    return 0


UI_COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")


def cmd_ui(args) -> int:
    localenv = _checkout(
        "localenv", "`onceflow ui` (airflow standalone on the checkout's DAGs folder, with a "
        "local PostgreSQL and Spark)", "In your own Airflow, a DAG file of yours gives the "
        "pipelines their DAGs (docs/write-your-own-pipeline.md) and onceflow's view is in "
        "its navigation")
    localenv.embedded_env()
    home = os.environ["AIRFLOW_HOME"]
    # The ports standalone was given, kept so that one component started again alone
    # (--only) serves its logs where the API server looks for them.
    kept = os.path.join(home, "onceflow-ui-ports.json")
    if args.only is None or not os.path.exists(kept):
        ports = localenv.ui_env(args.port)
        with open(kept, "w", encoding="utf-8") as out:
            json.dump(ports, out)
    else:
        with open(kept, encoding="utf-8") as found:
            ports = json.load(found)
        if args.port is not None or args.only == "api-server":
            ports.update(localenv.ui_env(args.port or int(ports["AIRFLOW__API__PORT"])))
    os.environ.update(ports)
    if args.only is None:
        cmd_init(argparse.Namespace(pipeline=None, pipelines=_refs(args)))
    print(f"Airflow UI: http://127.0.0.1:{ports['AIRFLOW__API__PORT']}  user admin, password "
          f"in {home}/simple_auth_manager_passwords.json.generated")
    print(f"log servers: the scheduler's on port "
          f"{ports['AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT']}, the triggerer's on port "
          f"{ports['AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT']}")
    print(f"DAGs folder {localenv.project_dir() / 'dags'}; stop with Ctrl-C")
    sys.stdout.flush()
    os.execvp("airflow", ["airflow", args.only or "standalone"])
    return 0  # not reached


# -- the parser -----------------------------------------------------------------------------------
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
    p.add_argument("--flush-s", type=_positive_float, default=1.0, metavar="S",
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
    p.add_argument("--before", type=_non_negative, required=True,
                   help="first offset to keep")
    p.add_argument("--partition", type=_non_negative, help="only this partition (default: all)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.pipelines:
        # in the environment: the processes a command starts (Airflow, Spark) find them too
        os.environ[settings.env_name("pipelines")] = ",".join(
            filter(None, [settings.get("pipelines"), *args.pipelines]))
        args.pipelines = ()
    return run_command(f"onceflow {args.command}", args.func, args)


def run_command(prog: str, func, args) -> int:
    """``func(args)``'s exit status, the way every onceflow command ends (the examples' demo
    commands too): a user's mistake (Permanent) is one line naming it and exit 2, another
    onceflow failure one line and exit 1, never a traceback."""
    try:
        return func(args)
    except (Permanent, Unavailable) as error:  # a PostgreSQL that does not answer: exit 2
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except OnceflowError as error:
        print(f"{prog}: failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
