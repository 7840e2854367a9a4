"""The `onceflow` command.

Exit codes: 0 done; 1 a failure (verify found a mismatch, a run failed, status found the
pipeline stalled); 2 a usage or configuration error (a bad argument, an unknown or invalid
pipeline, a database that does not answer), always with one line saying what to change; 3
(verify) no mismatch, but a txid could not be re-read.
"""

from __future__ import annotations

import logging
import os
import sys

from onceflow.cli.args import positive_int
from onceflow.cli.parser import build_parser
from onceflow.core import settings
from onceflow.core.errors import OnceflowError, Permanent, Unavailable

__all__ = ["build_parser", "main", "positive_int", "run_command"]


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
