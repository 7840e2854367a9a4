"""What the commands share: the pipeline an argument names, argparse types, progress
lines, and the checkout's development helpers."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time

from onceflow.core.errors import ConfigError
from onceflow.core.registry import get_pipeline, invalid_pipelines, pipelines


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
def pipeline_refs(args) -> tuple[str, ...]:
    return tuple(getattr(args, "pipelines", None) or ())


def known_pipelines(args) -> dict:
    return pipelines(pipeline_refs(args))


def chosen_pipeline(args):
    """The pipeline --pipeline names; without it, the only registered one."""

    name = getattr(args, "pipeline", None)
    if name is None:
        known = known_pipelines(args)
        invalid = invalid_pipelines(pipeline_refs(args))
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
    return get_pipeline(name, pipeline_refs(args))


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0: give 1 or more")
    return value


def positive_float(text: str) -> float:
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


def checkout_module(module: str, what: str, instead: str):
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
