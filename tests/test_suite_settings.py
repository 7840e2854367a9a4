"""How the suite itself runs: under CI (the CI environment variable, which .ci/run sets),
hypothesis is derandomized and has no per-example deadline (onceflow_testing.plugin), so a CI
run cannot pass once and fail the next time on the same code, nor fail on a loaded machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
from hypothesis import settings


def test_profile():
    print("PROFILE", settings.default.derandomize, settings.default.deadline)
"""


def profile(tmp_path: Path, ci: str | None, *extra: str) -> str:
    test = tmp_path / "test_probe.py"
    test.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tmp_path),
         "-p", "onceflow_testing.plugin", "-p", "no:cacheprovider", "-q", "-s", *extra,
         str(test)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("PROFILE"))


@pytest.mark.parametrize("ci, expected", [("true", "PROFILE True None"),
                                          (None, "PROFILE False 0:00:00.200000")])
def test_hypothesis_is_derandomized_under_ci(tmp_path, ci, expected):
    assert profile(tmp_path, ci) == expected


def test_an_explicit_hypothesis_profile_wins(tmp_path):
    assert profile(tmp_path, "true", "--hypothesis-profile", "default") == \
        "PROFILE False 0:00:00.200000"
