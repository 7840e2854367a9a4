"""The commands that set up and operate pipelines: init, pipelines, status, verify, reset,
retention, backfill, replay-dead-letters, repair, release."""

from __future__ import annotations

import getpass
import logging
import os
import sys

from onceflow.airflow.backfill import starter
from onceflow.cli.args import (
    Progress,
    checkout_module,
    chosen_pipeline,
    known_pipelines,
    pipeline_refs,
)
from onceflow.core import db, txlog
from onceflow.core.backflow import replay_dead_letters
from onceflow.core.db import transaction
from onceflow.core.errors import ConfigError, Permanent, SharedTable
from onceflow.core.registration import external_dsns, register, reset_offsets
from onceflow.core.registry import invalid_pipelines
from onceflow.core.txlog import TxState
from onceflow.kvstate import check_state_config
from onceflow.ops import retention, verify
from onceflow.ops.backfill import backfill
from onceflow.ops.repair import repair
from onceflow.ops.status import pipeline_status, release_command, render
from onceflow.sources import catalog
from onceflow.sources.pglog import PostgresLog

log = logging.getLogger("onceflow.cli")


def cmd_init(args) -> int:
    dsn = db.dsn_from_env()
    # the declarations first: pipelines that cannot load together create nothing
    chosen = [chosen_pipeline(args)] if args.pipeline else list(known_pipelines(args).values())
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
        for bad in invalid_pipelines(pipeline_refs(args)).values():
            refused += 1
            print(f"pipeline {bad.name} not set up: {bad.message()}", file=sys.stderr)
    if not chosen:
        print("no pipeline is registered yet: see `onceflow pipelines`")
    return 2 if refused else 0


def cmd_pipelines(args) -> int:
    """Each pipeline with its declaration checked (Pipeline.build_topology): exit 2 when
    one is refused, each refused one marked and its reason under it."""
    known, invalid = known_pipelines(args), invalid_pipelines(pipeline_refs(args))
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


def cmd_status(args) -> int:
    pipeline = chosen_pipeline(args)
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
    pipeline = chosen_pipeline(args)
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
    pipeline = chosen_pipeline(args)
    if not args.force_from_start:
        print("onceflow reset: nothing done: pass --force-from-start to forget the committed "
              "offsets (records are read again and counted again)", file=sys.stderr)
        return 2
    with db.connection() as conn:
        instance = reset_offsets(conn, pipeline)
    print(f"pipeline {pipeline.name}: offsets forgotten, new instance {instance}")
    return 0


def _source_of_topic(args, topic: str):
    for p in known_pipelines(args).values():
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
    by_name = {p.name: p for p in known_pipelines(args).values()}
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
    pipeline = chosen_pipeline(args)
    dag_id = args.dag_id or f"onceflow_{pipeline.name}"
    load = None
    if args.via == "local" and not args.dry_run:
        instead = ("Backfill with --via airflow (the default): the runs are queued for your "
                   "Airflow's scheduler")
        demo = checkout_module("demo", "`onceflow backfill --via local` (DAG runs here with "
                         "dag.test(), from the checkout's dags/ folder)", instead)
        localenv = checkout_module("localenv", "`onceflow backfill --via local`", instead)
        localenv.embedded_env()

        def load():
            return demo.load_dag(localenv.project_dir() / "dags", dag_id)
    with db.connection() as conn:
        done = backfill(conn, pipeline.name, starter(args.via, dag_id, load), args.dry_run)
    return 0 if all(state in ("success", "queued") for _, _, state in done) else 1


def cmd_replay_dead_letters(args) -> int:
    pipeline = chosen_pipeline(args)
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
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return f"uid {os.getuid()}"


def cmd_repair(args) -> int:
    pipeline = chosen_pipeline(args)
    with db.connection() as conn:
        report = repair(conn, pipeline, apply=args.yes, accept_changed=args.accept_changed or (),
                        skip_changed=args.skip_changed or ())
    print("\n".join(report.lines()))
    return 0 if report.ok and not report.unresolved else 1


def cmd_release(args) -> int:
    pipeline = chosen_pipeline(args)
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
