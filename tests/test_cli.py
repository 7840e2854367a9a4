"""The `onceflow` command: help, init / produce / status / verify, repair, and errors a user
can act on (the setting, the value, the fix; exit 2; no traceback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import run_transaction, table
from onceflow.cli import main
from onceflow.core.errors import ConfigError
from onceflow.core.pipeline import StateSpec
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.sources.pglog import BadRecord, PostgresLog
from tweets_example.data import generate


def cli(*args: str, stdin: str | None = None, env: dict | None = None):
    import os

    return subprocess.run([sys.executable, "-m", "onceflow.cli", *args], input=stdin,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_help_lists_every_command():
    out = cli("--help")
    assert out.returncode == 0
    for command in ("pg", "init", "pipelines", "produce", "status", "verify", "backfill",
                    "retention", "reset", "replay-dead-letters", "repair", "ui", "dags"):
        assert command in out.stdout
    assert "ONCEFLOW_PG_DSN" in out.stdout and "ONCEFLOW_PIPELINES" in out.stdout
    for command in ("status", "retention", "repair"):
        assert cli(command, "--help").returncode == 0


def test_dags_prints_the_dag_file_the_checkout_has(tmp_path):
    """`onceflow dags` gives a wheel's user the DAG file: the checkout's, to the byte, and a
    file Airflow's safe-mode parse opens (it says "airflow" and "dag")."""
    from pathlib import Path

    out = cli("dags")
    assert out.returncode == 0, out.stderr
    shipped = Path(__file__).resolve().parents[1] / "dags" / "onceflow_pipelines.py"
    assert out.stdout == shipped.read_text()
    assert "airflow" in out.stdout.lower() and "dag" in out.stdout.lower()


def produce_lines(n: int, seed: int = 42, **shares) -> str:
    return "\n".join(generate(n, seed=seed, **shares)) + "\n"


def test_init_produce_status_verify(spark, dsn, conn, capsys):
    assert main(["init"]) == 0
    assert main(["init"]) == 0  # idempotent
    assert "none (up to date)" in capsys.readouterr().out
    out = cli("produce", "--pipeline", "tweets", stdin=produce_lines(500, malformed_share=0.1))
    assert out.returncode == 0 and "produced 500 records" in out.stdout
    assert table(conn, "SELECT count(*) FROM source_log") == [(500,)]
    run_transaction(spark, dsn, conn, get_pipeline("tweets", batch_size=400), "run-1")
    capsys.readouterr()
    assert main(["status", "--pipeline", "tweets"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+1\s+1 committed ", out, re.M) and "p0: log_start=0" in out
    assert max(map(len, out.splitlines())) <= 100
    assert main(["status", "--pipeline", "tweets", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["last_committed"] == 1 and len(status["partitions"]) == 4
    assert main(["verify", "--pipeline", "tweets", "--recount"]) == 0
    assert "verify tweets (recount): OK: 400 source records = 400 committed" in \
        capsys.readouterr().out


def test_verify_exits_non_zero_on_a_mismatch(spark, dsn, conn, capsys):
    main(["init"])
    get_pipeline("tweets").source.append(conn, generate(100))
    run_transaction(spark, dsn, conn, get_pipeline("tweets"), "run-1")
    with conn.cursor() as cur:
        cur.execute("DELETE FROM url_counts WHERE key = (SELECT min(key) FROM url_counts)")
    conn.commit()
    assert main(["verify", "--pipeline", "tweets", "--recount"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    # an unknown pipeline names the ones there are
    (["verify", "--pipeline", "nope"],
     "pipeline='nope' is not registered: known pipelines are orders, orders_files, tweets, "
     "tweets_files, tweets_first_seen"),
    (["status", "--pipeline", "nope"], "pipeline='nope' is not registered"),
    (["backfill", "--pipeline", "nope", "--dry-run"], "pipeline='nope' is not registered"),
    # several pipelines: which one must be said
    (["status"], "--pipeline is needed: choose one of orders, orders_files, tweets,"),
    (["produce", "--pipeline", "tweets", "--file", "/nonexistent"],
     "--file='/nonexistent' does not exist"),
    (["replay-dead-letters", "--pipeline", "tweets", "--record", "x"],
     "--record='x' is invalid: give PARTITION:OFFSET"),
])
def test_bad_input_is_named(dsn, capsys, argv, message):
    main(["init"])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, why", [
    (["status", "--limit", "-5"], "argument --limit: -5 is negative"),
    (["status", "--limit", "0"], "argument --limit: 0: give 1 or more"),
    (["retention", "--topic", "t", "--before", "x"], "--before: 'x' is not a whole number"),
])
def test_bad_numbers_exit_2_with_the_reason(argv, why, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("payload, why", [
    ("", "record 2 is empty"),
    ("a\x00b", "record 2 holds a NUL character"),
])
def test_produce_refuses_a_bad_record_by_number_and_writes_none_of_its_chunk(dsn, conn,
                                                                            payload, why):
    main(["init"])
    out = cli("produce", "--pipeline", "tweets", stdin=f'{{"url": "x"}}\n{payload}\n')
    assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr
    assert table(conn, "SELECT count(*) FROM source_log") == [(0,)]


def test_produce_refuses_a_lone_surrogate(dsn, conn):
    main(["init"])
    with pytest.raises(BadRecord, match="record 1 is not valid UTF-8 text"):
        PostgresLog(topic="tweets").append(conn, ["\ud800"])


def test_an_unreachable_database_says_which_and_how_to_fix(capsys):
    """Refused connections are tried again (each try logged) for pg_connect_retry_s; the
    advice fits an installed onceflow: the DSN and where it comes from, not run.sh."""
    dsn = "postgresql://someone:s3cret@127.0.0.1:1/onceflow"
    out = cli("status", "--pipeline", "tweets",
              env={"ONCEFLOW_PG_DSN": dsn, "ONCEFLOW_PG_CONNECT_RETRY_S": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "PostgreSQL at" in out.stderr and "port=1" in out.stderr
    assert "s3cret" not in out.stderr and "ONCEFLOW_PG_DSN" in out.stderr
    assert "onceflow_pg" in out.stderr and "run.sh" not in out.stderr
    assert "try 1 failed, trying again in 0.5s" in out.stderr
    assert "2 tries in" in out.stderr and "Connection refused" in out.stderr


def test_repair_says_what_it_will_do_then_does_it(dsn, conn, capsys):
    from onceflow.core.begin import begin

    main(["init"])
    pipeline = get_pipeline("tweets")
    pipeline.source.append(conn, generate(100))
    begin(conn, pipeline, "run-1")
    with conn.cursor() as cur:  # its run died an hour ago; someone edited the coordinator
        cur.execute("UPDATE transactions SET heartbeat_at = now() - interval '1 hour'")
        cur.execute("UPDATE pipelines SET next_txid = 1, last_committed_txid = 5 "
                    "WHERE name = 'tweets'")
    conn.commit()
    capsys.readouterr()
    assert main(["repair", "--pipeline", "tweets"]) == 1  # something is wrong, not fixed yet
    said = capsys.readouterr().out
    assert "would repair (pass --yes to do it)" in said
    assert "next_txid is 1 but txid 1 exists" in said
    assert "last_committed_txid is 5 but the transaction log says 0" in said
    assert "txid 1 attempt 1 is planned but its run run-1 has not reported" in said
    assert table(conn, "SELECT next_txid, last_committed_txid FROM pipelines "
                       "WHERE name = 'tweets'") == [(1, 5)]  # nothing done yet
    assert main(["repair", "--pipeline", "tweets", "--yes"]) == 0
    assert "repaired:" in capsys.readouterr().out
    assert table(conn, "SELECT next_txid, last_committed_txid FROM pipelines "
                       "WHERE name = 'tweets'") == [(2, 0)]
    assert table(conn, "SELECT state FROM transactions") == [("failed",)]
    assert main(["repair", "--pipeline", "tweets"]) == 0
    assert "nothing to repair" in capsys.readouterr().out


def test_a_stored_topic_that_differs_is_refused(conn):
    register(conn, get_pipeline("tweets"), create_source=True)
    with pytest.raises(ConfigError, match="topic='other' but the pipeline is stored with "
                                          "topic 'tweets'"):
        register(conn, get_pipeline("tweets", source=PostgresLog(topic="other")),
                 create_source=True)


def test_an_unknown_topic_is_refused(conn):
    with pytest.raises(ConfigError, match="source topic='nope' is unknown"):
        register(conn, get_pipeline("tweets", source=PostgresLog(topic="nope")))


@pytest.mark.parametrize("overrides, field", [
    ({"batch_size": 0}, "pipeline.batch_size=0"),
    ({"mode": "eventual"}, "pipeline.mode='eventual'"),
    ({"groups": -1}, "pipeline.groups=-1"),
    ({"max_per_partition": -5}, "pipeline.max_per_partition=-5"),
    ({"start_policy": "yesterday"}, "pipeline.start_policy='yesterday'"),
    ({"start_policy": "timestamp:not-a-date"}, "pipeline.start_policy='timestamp:not-a-date'"),
    ({"out_of_range": "skip"}, "pipeline.out_of_range='skip'"),
    ({"max_key_bytes": 5000}, "pipeline.max_key_bytes=5000"),
    ({"source": PostgresLog(topic="t", partitions=0)}, "source.partitions=0"),
    # a state in another database must be opaque
    ({"states": (StateSpec("x", "transactional", conn_id="db2"),)},
     "state[x].kind='transactional'"),
])
def test_bad_pipeline_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        get_pipeline("tweets", **overrides)


# -- replaying dead letters of a pipeline that asks for approvals ----------------------------------
def _dead_letter(conn, pipeline: str, partition: int, offset: int) -> None:
    from onceflow.core import backflow

    with conn.cursor() as cur:
        backflow.ensure_pointers(cur, pipeline)
        cur.execute("""INSERT INTO dead_letters (pipeline, partition, "offset", payload,
                                                 failures, errors, txid)
                       VALUES (%s, %s, %s, '{}', 4, ARRAY['bolt x: ValueError: bad'], 1)""",
                    (pipeline, partition, offset))
    conn.commit()


def test_replaying_dead_letters_of_an_approval_pipeline_needs_force(dsn, conn):
    """A pipeline with dead_letter_approval: the CLI refuses (exit 2, naming the approval
    DAG and --force), moves nothing, and status names the approval path, not this command;
    with --force it replays and logs it, with who (--by, else the OS user)."""
    import getpass

    refs = ("--pipelines", "helpers:TWEETS_APPROVED")
    assert cli(*refs, "init", "--pipeline", "tweets_approved").returncode == 0
    _dead_letter(conn, "tweets_approved", 0, 3)
    _dead_letter(conn, "tweets_approved", 1, 7)
    refused = cli(*refs, "replay-dead-letters", "--pipeline", "tweets_approved",
                  "--record", "0:3")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "dead_letter_approval" in refused.stderr and "--force" in refused.stderr
    assert "onceflow_tweets_approved_replay_dead_letters" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(2,)]

    status = cli(*refs, "status", "--pipeline", "tweets_approved", "--json")
    fix = json.loads(status.stdout)["dead_letters"]["fix"]
    assert "onceflow_tweets_approved_replay_dead_letters" in fix and "Required actions" in fix
    assert "onceflow replay-dead-letters" not in fix
    text = cli(*refs, "status", "--pipeline", "tweets_approved").stdout
    assert "onceflow replay-dead-letters" not in text
    assert "onceflow_tweets_approved_replay_dead_letters" in " ".join(text.split())

    forced = cli(*refs, "replay-dead-letters", "--pipeline", "tweets_approved", "--record",
                 "0:3", "--force", "--by", "alice")
    assert forced.returncode == 0, forced.stderr
    assert "put 1 dead letter(s)" in forced.stdout
    assert re.search(r"WARNING .*REPLAY pipeline=tweets_approved: 1 dead letter\(s\) put back "
                     r"WITHOUT approval \(--force, by alice", forced.stderr), forced.stderr
    assert table(conn, 'SELECT partition, "offset" FROM dead_letters') == [(1, 7)]
    by_os = cli(*refs, "replay-dead-letters", "--pipeline", "tweets_approved", "--all",
                "--force")
    assert by_os.returncode == 0 and f"by {getpass.getuser()};" in by_os.stderr, by_os.stderr
    assert table(conn, "SELECT count(*) FROM dead_letters") == [(0,)]


def test_a_pipeline_without_approvals_names_the_cli_to_replay(dsn, conn):
    main(["init"])
    _dead_letter(conn, "tweets", 0, 3)
    status = cli("status", "--pipeline", "tweets", "--json")
    assert "onceflow replay-dead-letters --pipeline tweets" in json.loads(
        status.stdout)["dead_letters"]["fix"]
    done = cli("replay-dead-letters", "--pipeline", "tweets", "--record", "0:3")
    assert done.returncode == 0 and "put 1 dead letter(s)" in done.stdout, done.stderr


# -- producing from a live standard input ---------------------------------------------------------
def test_produce_from_stdin_writes_records_as_they_come(dsn, conn):
    """A producer that writes a few records and then waits: they are in the log within about
    --flush-s, while standard input is still open; a --chunk of 2 writes in twos; a bad
    record is named by its number over the whole input."""
    import os
    import time

    main(["init"])

    def count() -> int:
        conn.rollback()
        return table(conn, "SELECT count(*) FROM source_log")[0][0]

    producer = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "produce", "--pipeline", "tweets",
         "--flush-s", "0.3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        lines = produce_lines(5).encode()
        producer.stdin.write(lines)
        producer.stdin.flush()
        deadline = time.monotonic() + 30  # the interpreter's start, then 0.3 s
        while count() < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert count() == 5 and producer.poll() is None  # written, the pipe still open
        producer.stdin.write(produce_lines(3, seed=7).encode())
        producer.stdin.close()
        producer.wait(30)
        out, err = producer.stdout.read(), producer.stderr.read()
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert producer.returncode == 0, err
    assert "produced 8 records" in out.decode()
    assert count() == 8

    # --chunk 2: written in twos (4 chunks for 7 records); a bad 9th record over the input
    out = cli("produce", "--pipeline", "tweets", "--chunk", "2", "--flush-s", "5",
              stdin=produce_lines(7, seed=8))
    assert out.returncode == 0 and "produced 7 records" in out.stdout
    assert len(re.findall(r"produced \d records to tweets", out.stderr)) == 4, out.stderr
    out = cli("produce", "--pipeline", "tweets", stdin=produce_lines(8, seed=9) + "\n")
    assert out.returncode == 2 and "record 9 is empty" in out.stderr
    assert count() == 15


def test_ui_uses_the_port_it_prints_and_free_log_server_ports():
    """`onceflow ui`'s Airflow settings: the API server on --port, the task runners pointed
    at it; a taken port refused with the fix; log servers moved off taken ports."""
    import socket

    from onceflow.dev.localenv import LOG_PORTS, free_port, port_free, ui_env

    port = free_port()
    env = ui_env(port, environ={})
    assert env["AIRFLOW__API__PORT"] == str(port)
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == \
        f"http://127.0.0.1:{port}/execution/"
    assert ui_env(None, environ={"AIRFLOW__API__PORT": str(port)})["AIRFLOW__API__PORT"] == \
        str(port)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=rf"port {port} of 127.0.0.1 is taken.*--port"):
            ui_env(port, environ={})
    held = []
    try:
        for default in LOG_PORTS.values():
            if port_free(default):
                s = socket.socket()
                s.bind(("127.0.0.1", default))
                s.listen()
                held.append(s)
        env = ui_env(free_port(), environ={})
        for key, default in LOG_PORTS.items():
            chosen = int(env[f"AIRFLOW__LOGGING__{key.upper()}"])
            assert chosen != default and port_free(chosen)
        kept = ui_env(free_port(), environ={"AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": "9911"})
        assert kept["AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT"] == "9911"
    finally:
        for s in held:
            s.close()


@pytest.mark.timeout(240)
def test_ui_only_one_component_answers_on_the_url_it_prints(airflow_db, tmp_path):
    """`onceflow ui --port P --only api-server` (one component alone, as to restart it): it
    prints http://127.0.0.1:P, that URL answers (Airflow's health, the UI page), it keeps
    the ports it chose in its Airflow home for the next --only, and stopping its process
    group (by the PID the test started) leaves nothing listening or running."""
    import os
    import signal
    import socket
    import time
    import urllib.request
    from pathlib import Path

    from onceflow.dev.localenv import free_port

    port = free_port()
    kept = Path(airflow_db) / "onceflow-ui-ports.json"
    kept.unlink(missing_ok=True)  # as a first --only: ports chosen, not read
    log = tmp_path / "ui.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", "ui", "--port", str(port), "--only",
             "api-server"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "AIRFLOW__API__WORKERS": "1"}, start_new_session=True)
    try:
        deadline, health = time.monotonic() + 180, None
        while health is None:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            printed = re.search(r"Airflow UI: (http://\S+)", log.read_text(errors="replace"))
            if printed:
                try:
                    with urllib.request.urlopen(f"{printed[1]}/api/v2/monitor/health",
                                                timeout=3) as answer:
                        health = json.load(answer)
                except OSError:
                    pass
            time.sleep(0.5)
        assert printed[1] == f"http://127.0.0.1:{port}"
        assert health["metadatabase"]["status"] == "healthy", health
        with urllib.request.urlopen(printed[1], timeout=10) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
        ports = json.loads(kept.read_text())
        assert ports["AIRFLOW__API__PORT"] == str(port)
        assert ports["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == \
            f"http://127.0.0.1:{port}/execution/"
        assert f"the scheduler's on port {ports['AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT']}" \
            in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        kept.unlink(missing_ok=True)
    # the group's other processes (the API server's workers) are gone too, and the port is
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a process of the UI's group is still running"
        time.sleep(0.2)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=3).close()


def test_status_exits_1_when_stalled_and_says_a_jvm_error_in_one_line(spark, dsn, conn,
                                                                      capsys):
    """In flight only: exit 0. A txid failed with a real Spark error (its JVM stack trace,
    stored as the task stores it, repr and all): exit 1, the STALLED line names it, and the
    reason is one line with its cause, no JVM frames."""
    from helpers import tweets_pipeline
    from onceflow.core.begin import begin, mark_failed
    from onceflow.ops.status import brief

    tweets_pipeline(conn, events=400, batch_size=200)
    batch = begin(conn, get_pipeline("tweets", batch_size=200), "run-1")
    capsys.readouterr()
    assert main(["status", "--pipeline", "tweets"]) == 0  # in flight, its holder reporting
    out = capsys.readouterr().out
    assert "txid 1 (planned)" in out and "STALLED" not in out
    try:
        spark.range(3).selectExpr("assert_true(id < 1, 'a bad record')").collect()
    except Exception as error:  # noqa: BLE001 (Spark's own type, whichever it is)
        failure = error
    # as PySpark words it with spark.sql.pyspark.jvmStacktrace.enabled, stored as
    # run_batches stores it (a task stores an exception's repr: escaped breaks, tried below)
    reason = f"{type(failure).__name__}: {failure}\n\nJVM stacktrace:\n{failure._stackTrace}"
    assert reason.count("\n\tat ") > 10  # the JVM's frames, as the issue saw them
    assert "\\tat " not in brief(repr(reason)) and "a bad record" in brief(repr(reason))
    mark_failed(conn, "tweets", batch.attempt, reason)
    capsys.readouterr()
    assert main(["status", "--pipeline", "tweets"]) == 1
    out = capsys.readouterr().out
    assert "\tat " not in out and "\\tat " not in out and "JVM stacktrace" not in out, out
    said = out[out.index("txid 1 (failed)"):out.index("-> the next run adopts it")]
    assert len(said.splitlines()) <= 3 and "a bad record" in said, said  # wrapped at 100
    assert "STALLED until someone acts (each is listed above): txid 1 failed" in out
    capsys.readouterr()
    assert main(["status", "--pipeline", "tweets", "--json"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["stalled"] == ["txid 1 failed"]
    assert shown["transactions"][0]["reason"] == reason[:2000]  # kept whole for --json


BAD = """from onceflow import Pipeline, PostgresLog, StateSpec

BAD = Pipeline(name="bad", source=PostgresLog(topic="bad"), topology="x:y",
               states=(StateSpec("bad_counts"),), batch_size=0)
"""


def test_one_invalid_pipeline_stops_no_other_and_is_named_with_its_module(
        tmp_path, monkeypatch, dsn, conn, capsys):
    """batch_size=0 in one registered pipeline: the others' commands work; a command for it
    exits 2 naming the pipeline, its module, the field, the value and the fix; `pipelines`
    lists it as invalid and `init` sets up the others."""
    from onceflow.core.registry import clear_cache

    (tmp_path / "bad_pipes.py").write_text(BAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ONCEFLOW_PIPELINES", "bad_pipes:BAD")
    clear_cache()
    try:
        capsys.readouterr()
        assert main(["init"]) == 2
        out = capsys.readouterr()
        assert "pipeline tweets ready" in out.out
        said = ("pipeline 'bad' (from bad_pipes:BAD) is invalid: pipeline.batch_size=0 is "
                "invalid: give a positive number of records per transaction")
        assert f"pipeline bad not set up: {said}" in out.err
        assert table(conn, "SELECT count(*) FROM pipelines WHERE name = 'bad'") == [(0,)]
        assert main(["status", "--pipeline", "tweets"]) == 0
        assert main(["status", "--pipeline", "bad"]) == 2
        assert said in capsys.readouterr().err
        assert main(["pipelines"]) == 2
        out = capsys.readouterr()
        assert ("bad: INVALID (from bad_pipes:BAD):\n    pipeline.batch_size=0 is invalid"
                in out.out)
        assert re.search(r"^tweets: postgres-log source 'tweets'", out.out, re.M)
        assert "1 of " in out.err and "Traceback" not in out.out + out.err
    finally:
        clear_cache()
