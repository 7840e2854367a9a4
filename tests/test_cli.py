"""The `onceflow` command: help, init / produce / status / verify, and clear errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import run_transaction, table
from onceflow.cli import main
from onceflow.coordinator import register
from onceflow.pipeline import ConfigError, StateSpec, get_pipeline


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "onceflow.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("pg", "init", "produce", "status", "verify", "demo", "ui"):
        assert command in out
    assert "ONCEFLOW_PG_DSN" in out


def test_init_produce_status_verify(spark, dsn, conn, capsys):
    assert main(["init"]) == 0
    assert main(["init"]) == 0  # idempotent
    assert "none (up to date)" in capsys.readouterr().out
    assert main(["produce", "--events", "500", "--malformed-share", "0.1"]) == 0
    assert table(conn, "SELECT count(*) FROM source_log") == [(500,)]
    run_transaction(spark, dsn, conn, get_pipeline("tweets", batch_size=400), "run-1")
    capsys.readouterr()
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "txid=1 attempt=1 state=committed" in out and "partition=0" in out
    assert main(["verify"]) == 0
    assert "verify tweets: OK: 400 source records = 400 committed" in capsys.readouterr().out


def test_verify_exits_non_zero_on_a_mismatch(spark, dsn, conn, capsys):
    main(["init"])
    main(["produce", "--events", "100"])
    run_transaction(spark, dsn, conn, get_pipeline("tweets"), "run-1")
    with conn.cursor() as cur:
        cur.execute("DELETE FROM url_counts WHERE key = (SELECT min(key) FROM url_counts)")
    conn.commit()
    assert main(["verify"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["verify", "--pipeline", "nope"], "pipeline='nope' is not registered"),
    (["produce", "--malformed-share", "2"], "malformed_share=2.0 must be between 0 and 1"),
])
def test_bad_input_is_named(dsn, capsys, argv, message):
    main(["init"])
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_stored_topic_that_differs_is_refused(conn):
    register(conn, get_pipeline("tweets"), create_topic=True)
    with pytest.raises(ConfigError, match="pipeline.topic='other' .* stored with topic 'tweets'"):
        register(conn, get_pipeline("tweets", topic="other"), create_topic=True)


def test_an_unknown_topic_is_refused(conn):
    with pytest.raises(ConfigError, match="pipeline.topic='nope' is unknown"):
        register(conn, get_pipeline("tweets", topic="nope"))


@pytest.mark.parametrize("overrides, field", [
    ({"batch_size": 0}, "pipeline.batch_size=0"),
    ({"mode": "eventual"}, "pipeline.mode='eventual'"),
    ({"groups": -1}, "pipeline.groups=-1"),
    ({"max_per_partition": -5}, "pipeline.max_per_partition=-5"),
    ({"start_policy": "yesterday"}, "pipeline.start_policy='yesterday'"),
    ({"start_policy": "timestamp:not-a-date"}, "pipeline.start_policy='timestamp:not-a-date'"),
    ({"out_of_range": "skip"}, "pipeline.out_of_range='skip'"),
    # a state in another database must be opaque
    ({"states": (StateSpec("x", "transactional", conn_id="db2"),)},
     "state[x].kind='transactional'"),
])
def test_bad_pipeline_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        get_pipeline("tweets", **overrides)
