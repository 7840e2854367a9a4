"""The commands of a local deployment: pg, spark, dags, ui."""

from __future__ import annotations

import argparse
import json
import os
import sys

from onceflow.cli.args import checkout_module, pipeline_refs
from onceflow.cli.operate import cmd_init
from onceflow.core.errors import ConfigError
from onceflow.sources.jvm import ENABLED, JAR, built_for, installed_spark, unusable
from onceflow.spark import localspark


def cmd_pg(args) -> int:
    localpg = checkout_module(
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
    from onceflow.airflow.dag_file import TEXT  # loads Airflow: only `onceflow dags` needs it

    sys.stdout.write(TEXT)
    return 0


UI_COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")


def cmd_ui(args) -> int:
    localenv = checkout_module(
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
        cmd_init(argparse.Namespace(pipeline=None, pipelines=pipeline_refs(args)))
    print(f"Airflow UI: http://127.0.0.1:{ports['AIRFLOW__API__PORT']}  user admin, password "
          f"in {home}/simple_auth_manager_passwords.json.generated")
    print(f"log servers: the scheduler's on port "
          f"{ports['AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT']}, the triggerer's on port "
          f"{ports['AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT']}")
    print(f"DAGs folder {localenv.project_dir() / 'dags'}; stop with Ctrl-C")
    sys.stdout.flush()
    os.execvp("airflow", ["airflow", args.only or "standalone"])
    return 0  # not reached
