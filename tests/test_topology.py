"""The topology runner on real local Spark: bolts of both kinds, the acker's all-or-nothing
verdict per root, the per-record time budget, and declarations refused with a fix."""

from __future__ import annotations

import time
import uuid

import pytest
from pyspark.sql import functions as F

from onceflow.core.topology import ANCHORS, SPOUT, Topology, TopologyError
from onceflow.spark.ids import root_id
from onceflow.spark.runner import run_topology


def records(spark, payloads, replays=0):
    return spark.createDataFrame(
        [(i % 3, i, p, replays, False) for i, p in enumerate(payloads)],
        "partition int, offset long, payload string, replays int, replayed boolean")


def collect(run):
    out = run.collect()
    failures = {(p, o): error for (p, o, _), error in out.failed.items()}
    return out.deltas, out.rejected, failures


def split_words(df):
    """A DataFrame bolt: one tuple per word (with its position), words in one stream and
    lengths in another; an empty payload is rejected."""
    words = df.select(*ANCHORS, F.posexplode(F.split("payload", " ")).alias("_pos", "word"))
    return {
        "words": words.where(F.col("word") != "").select(*ANCHORS, "_pos",
                                                          F.col("word").alias("key")),
        "lengths": df.where(F.col("payload") != "").select(
            *ANCHORS, F.length("payload").cast("string").alias("key")),
        "empty": df.where(F.col("payload") == "").select(
            *ANCHORS, F.lit("empty payload").alias("error")),
    }


def words_topology(upper):
    return (
        Topology("words")
        .bolt("split", input=SPOUT, fn=split_words, outputs={
            "words": "key string", "lengths": "key string", "empty": "error string"})
        .record_bolt("upper", input="words", fn=upper, outputs={"upper": "key string"})
        .count("upper", "words")
        .count("lengths", "lengths")
        .reject("empty")
    )


def test_a_record_counts_fully_or_not_at_all(spark):
    def upper(values):  # fails on a word with a digit: the whole record must count nothing
        if any(c.isdigit() for c in values["key"]):
            raise ValueError(f"digit in {values['key']!r}")
        return [{"key": values["key"].upper()}]

    src = records(spark, ["a b", "b c9 d", "", "a"])
    deltas, rejects, failures = collect(run_topology(words_topology(upper), src, attempt=1))
    # record 1 ("b c9 d"): its "b", "d" and its length were emitted, but "c9" failed
    assert deltas == {("words", "A"): 2, ("words", "B"): 1, ("lengths", "3"): 1,
                      ("lengths", "1"): 1}
    assert rejects == {(2, 2): "empty payload"}
    assert failures == {(1, 1): "bolt upper: ValueError: digit in 'c9'"}


def test_without_the_acker_partial_effects_count(spark):
    def upper(values):
        if any(c.isdigit() for c in values["key"]):
            raise ValueError("digit")
        return [{"key": values["key"].upper()}]

    src = records(spark, ["b c9 d"])
    deltas, _, failures = collect(run_topology(words_topology(upper), src, attempt=1,
                                               acker=False))
    assert deltas == {("words", "B"): 1, ("words", "D"): 1, ("lengths", "6"): 1}
    assert failures == {}


def test_a_tuple_over_its_time_budget_fails(spark):
    def slow_upper(values):
        if values["_replays"] == 0:
            if values["key"] == "hangs":
                time.sleep(3600)  # interrupted at the budget: the batch does not wait
            if values["key"] == "stubborn":
                try:
                    time.sleep(3600)
                except Exception:  # swallows the interruption: failed when it returns
                    time.sleep(0.2)
        return [{"key": values["key"].upper()}]

    topology = words_topology(slow_upper)
    started = time.monotonic()
    deltas, _, failures = collect(run_topology(
        topology, records(spark, ["fast", "hangs x", "stubborn"]), attempt=1,
        tuple_timeout_ms=200))
    assert time.monotonic() - started < 60
    assert deltas == {("words", "FAST"): 1, ("lengths", "4"): 1}
    assert failures[(1, 1)] == ("bolt upper: TupleTimeout: interrupted after 200 ms, over "
                                "tuple_timeout_ms=200")
    assert failures[(2, 2)].startswith("bolt upper: TupleTimeout: took ")
    assert failures[(2, 2)].endswith(" ms, over tuple_timeout_ms=200")
    assert len(failures) == 2
    # replayed (replays 1), the same records complete
    deltas, _, failures = collect(run_topology(
        topology, records(spark, ["hangs x"], replays=1), attempt=1, tuple_timeout_ms=200))
    assert deltas == {("words", "HANGS"): 1, ("words", "X"): 1, ("lengths", "7"): 1}
    assert failures == {}


def test_a_failure_seen_on_a_later_pass_still_fails_its_record_whole(spark, tmp_path):
    """The verdict is settled by passes over the batch (the failed records left out whole).
    A bolt whose failures differ between passes (a timeout, a flaky service) must not let a
    record count in part: here a DataFrame bolt fails "late" the second time it sees it
    only, after the record's length was counted on another branch, so the record fails as a
    whole; and the passes end (a third reads what the second cached)."""
    seen = tmp_path / "seen"
    seen.mkdir()

    def why(word):
        marks = len(list(seen.glob(f"{word}.*")))
        # a unique name per sighting: two Python workers may see the same word at once
        (seen / f"{word}.{uuid.uuid4().hex}").touch()
        if word == "bad" or (word == "late" and marks == 1):
            return f"{word} on sighting {marks + 1}"
        return None

    flaky = F.udf(why, "string").asNondeterministic()

    def check(df):
        return df.select(*ANCHORS, F.col("key"), flaky("key").alias("_fail"))

    topology = (
        Topology("late")
        .bolt("split", input=SPOUT, fn=split_words, outputs={
            "words": "key string", "lengths": "key string", "empty": "error string"})
        .bolt("check", input="words", fn=check, outputs={"checked": "key string"})
        .count("checked", "words")
        .count("lengths", "lengths")
        .reject("empty")
    )
    src = records(spark, ["ok", "x bad", "late y", "ok z"])
    deltas, _, failures = collect(run_topology(topology, src, attempt=1))
    assert failures == {(1, 1): "bolt check: bad on sighting 1",
                        (2, 2): "bolt check: late on sighting 2"}
    assert deltas == {("words", "ok"): 2, ("words", "z"): 1, ("lengths", "2"): 1,
                      ("lengths", "4"): 1}
    # pass 1 fails bad; pass 2 (bad left out, outputs cached) fails late; pass 3 reads the
    # cache, so the bolt saw each word twice
    assert len(list(seen.glob("late.*"))) == 2
    assert len(list(seen.glob("ok.*"))) == 4  # two records with "ok", two runs of the bolt


def test_a_record_the_spout_refuses_is_read_again_only_then(spark):
    """Oversized payloads are refused at the spout (counted in the same pass, then read
    again); a batch with none makes no second read."""
    topology = words_topology(lambda values: [{"key": values["key"].upper()}])
    src = records(spark, ["a b", "x" * 100, "c"])
    out = run_topology(topology, src, attempt=1, max_record_bytes=50).collect()
    assert out.rejected == {(1, 1): "oversized record (100 bytes, over max_record_bytes=50)"}
    assert out.deltas == {("words", "A"): 1, ("words", "B"): 1, ("words", "C"): 1,
                          ("lengths", "3"): 1, ("lengths", "1"): 1}
    run = run_topology(topology, records(spark, ["a"]), attempt=1, max_record_bytes=50)
    assert run.collect().rejected == {}
    assert run.observed.get == {"refused": 0}


def test_a_run_told_there_are_no_refusals_counts_none_and_fails_on_one(spark):
    """refusals=False (the source said none of the batch could be refused): no observation,
    the same outputs; a record refused all the same fails the run naming it, never dropped."""
    topology = words_topology(lambda values: [{"key": values["key"].upper()}])
    src = records(spark, ["a b", "c"])
    run = run_topology(topology, src, attempt=1, max_record_bytes=50, refusals=False)
    assert run.observed is None
    assert run.collect().deltas == \
        run_topology(topology, src, attempt=1, max_record_bytes=50).collect().deltas
    bad = run_topology(topology, records(spark, ["a", "x" * 100]), attempt=1,
                       max_record_bytes=50, refusals=False)
    with pytest.raises(Exception, match=r"refused the record at partition 1 offset 1 "
                                        r"\(oversized record \(100 bytes"):
        bad.collect()


def test_a_dataframe_bolt_fails_tuples_with_fail_column(spark):
    def check(df):
        return df.select(*ANCHORS, F.col("payload").alias("key"),
                         F.when(F.col("payload").startswith("!"), F.lit("bang")).alias("_fail"))

    topology = (Topology("t").bolt("check", input=SPOUT, fn=check, outputs={"ok": "key string"})
                .count("ok", "seen"))
    deltas, _, failures = collect(run_topology(topology, records(spark, ["x", "!y", "x"]),
                                               attempt=3))
    assert deltas == {("seen", "x"): 2}
    assert failures == {(1, 1): "bolt check: bang"}


def test_a_tuple_for_a_stream_its_bolt_does_not_declare_fails_its_record(spark):
    """A bolt's output outside its declared outputs (issue 48: outputs good / bad, rows
    emitted as "rows") reaches no consumer: it fails its record, whole, with a reason naming
    the value and the outputs, instead of vanishing with the record counted complete. A
    DataFrame bolt's _stream (null too) and a per-record bolt's (stream, values) alike."""
    def route(df):  # the second word of the payload names the stream; a record of one
        words = F.split("payload", " ")  # word has none (null)
        return df.select(*ANCHORS, F.get(words, 1).alias("_stream"), words[0].alias("key"),
                         F.lit("bad one").alias("error"))

    def also_split(values):  # the same rule, emitting per record
        word, _, stream = values["key"].partition(":")
        return [("good2", {"key": word}), (stream, {"key": word})]

    topology = (Topology("routes")
                .bolt("route", input=SPOUT, fn=route,
                      outputs={"good": "key string", "bad": "error string"})
                .record_bolt("again", input="good", fn=also_split,
                             outputs={"good2": "key string", "bad2": "key string"})
                .count("good2", "seen").count("bad2", "seen").reject("bad"))
    src = records(spark, ["a:bad2 good", "b bad", "c rows", "d", "e:rows good", "f:good2 good"])
    deltas, rejects, failures = collect(run_topology(topology, src, attempt=1))
    assert deltas == {("seen", "a"): 2, ("seen", "f"): 2}
    assert rejects == {(1, 1): "bad one"}
    outputs = "which is not one of its declared outputs ['bad', 'good']: emit one of those, " \
              "or declare the stream in outputs"
    assert failures == {
        (2, 2): f"bolt route: emitted _stream='rows', {outputs}",
        (0, 3): f"bolt route: emitted _stream=null, {outputs}",
        (1, 4): "bolt again: TopologyError: emitted to stream 'rows', which is not one of "
                "its declared outputs ['bad2', 'good2']: emit to one of those, or declare "
                "the stream in outputs"}


def test_root_ids_keep_the_origin(spark):
    df = spark.createDataFrame([(5, 123456789, True), (4_000_000, (1 << 40) - 1, False)],
                               "partition int, offset long, replayed boolean")
    from onceflow.spark.ids import origin

    rows = df.select(root_id("partition", "offset", "replayed").alias("_root")) \
        .select("_root", *origin()).collect()
    assert [(r.partition, r.offset) for r in rows] == [(5, 123456789),
                                                       (4_000_000, (1 << 40) - 1)]
    assert rows[0]._root != rows[1]._root and rows[0]._root >> 62 == 1


@pytest.mark.parametrize("build, message", [
    (lambda t: t.bolt("b", input="nope", fn=None, outputs={"x": "key string"}).count("x", "s"),
     "input='nope' is not a stream declared before it"),
    (lambda t: t.bolt("b", input=SPOUT, fn=None, outputs={"x": "key string",
                                                         "y": "key string"}).count("x", "s"),
     r"stream\(s\) \['y'\] are emitted but nothing consumes them"),
    (lambda t: t.bolt("b", input=SPOUT, fn=None, outputs={SPOUT: "key string"}),
     "stream 'records' is already emitted by the spout"),
    (lambda t: t.bolt("b", input=SPOUT, fn=None, outputs={"x": "word string"}).count("x", "s"),
     r"count state 's' counts column 'key' of stream 'x' \(emitted by bolt 'b'\), which the "
     r"stream does not carry \(it has word\): name the counted column key"),
])
def test_bad_declarations_are_refused_naming_the_fix(build, message):
    with pytest.raises(TopologyError, match=message):
        build(Topology("bad")).validate()


def test_a_frame_bolt_that_drops_the_anchors_is_refused(spark):
    topology = (Topology("t").bolt("b", input=SPOUT, outputs={"x": "key string"},
                                   fn=lambda df: df.select(F.col("payload").alias("key")))
                .count("x", "s"))
    with pytest.raises(TopologyError, match=r"output lacks column\(s\) \['_root', '_tid'"):
        run_topology(topology, records(spark, ["a"]), attempt=1)


def test_a_stream_with_several_consumers_gives_each_a_copy(spark):
    """"words" feeds a Python bolt and a sink: each gets its own copy of every tuple, so the
    trees still balance, and a failure on one branch still drops the other's counts."""
    def upper(values):
        if values["key"] == "boom":
            raise RuntimeError("boom")
        return [{"key": values["key"].upper()}]

    topology = (
        Topology("fan-out")
        .bolt("split", input=SPOUT, fn=lambda df: split_words(df)["words"],
              outputs={"words": "key string"})
        .record_bolt("upper", input="words", fn=upper, outputs={"upper": "key string"})
        .count("words", "raw")
        .count("upper", "upper")
    )
    deltas, _, failures = collect(run_topology(topology, records(spark, ["a b", "a boom"]),
                                               attempt=2))
    assert deltas == {("raw", "a"): 1, ("raw", "b"): 1, ("upper", "A"): 1, ("upper", "B"): 1}
    assert failures == {(1, 1): "bolt upper: RuntimeError: boom"}


def test_a_typed_value_that_cannot_be_stored_fails_its_record_alone(spark):
    """A value over its declared numeric(p,s), or text with a NUL, would break the COPY into
    staging on every attempt (the whole batch stalled): the record fails alone, named."""
    from onceflow import Count, Last, StateSpec, Sum

    spec = StateSpec("totals", key={"k": "text"},
                     measures={"total": Sum("amount", "numeric(6,2)"), "n": Count(),
                               "note": Last("note", "text")})

    def parse(df):
        d = F.from_json("payload", "k string, amount double, note string").alias("d")
        return df.select(*ANCHORS, d).select(*ANCHORS, "d.*")

    topology = (Topology("typed")
                .bolt("parse", input=SPOUT, fn=parse,
                      outputs={"s": "k string, amount double, note string"})
                .sink("s", "totals"))
    payloads = ['{"k": "a", "amount": 1.5, "note": "x"}',
                '{"k": "b", "amount": 123456.0, "note": "y"}',
                '{"k": "c", "amount": 2.0, "note": "bad\\u0000"}',
                '{"k": "a", "amount": 2.25, "note": "z"}']
    out = run_topology(topology, records(spark, payloads), attempt=1,
                       shapes={"totals": spec.shape()}).collect()
    failures = {(p, o): error for (p, o, _), error in out.failed.items()}
    assert failures == {
        (1, 1): "table totals: measures['total'] = Sum('amount', 'numeric(6,2)'): value "
                "123456.0 does not fit numeric(6,2)",
        (2, 2): "table totals: column note holds a NUL character, which PostgreSQL text "
                "cannot store"}
    rows = out.tables["totals"].to_pylist()
    assert [(r["k"], str(r["total"]), r["n"], r["note"]) for r in rows] == [
        ("a", "3.75", 2, "z")]


def test_a_record_rejected_twice_is_staged_once_with_the_least_reason(spark):
    from onceflow.spark.processing import staging_of

    def split(df):
        return {"too_short": df.where(F.length("payload") < 3).select(
                    *ANCHORS, F.lit("z: too short").alias("error")),
                "no_space": df.where(~F.col("payload").contains(" ")).select(
                    *ANCHORS, F.lit("a: no space").alias("error")),
                "ok": df.where(F.col("payload").contains(" ")).select(
                    *ANCHORS, F.col("payload").alias("key"))}

    topology = (Topology("rejects")
                .bolt("split", input=SPOUT, fn=split, outputs={
                    "too_short": "error string", "no_space": "error string",
                    "ok": "key string"})
                .count("ok", "ok").reject("too_short").reject("no_space"))
    for acker in (True, False):
        out = run_topology(topology, records(spark, ["ab", "a b", "abcd"]), attempt=1,
                           acker=acker).collect()
        lines = staging_of(out, "t", lambda position: "").rejects.read().decode().splitlines()
        assert sorted(lines) == ['"t",0,0,"a: no space"', '"t",2,2,"a: no space"'], acker
        assert out.deltas == {("ok", "a b"): 1}


def keyed(df):
    """A DataFrame bolt for the key checks: the payload names the key its "k" tuple carries
    (``nul``: a key with a NUL, ``long``: 3,000 bytes, ``none``: null; else the payload), and
    every record also counts its length in "n"."""
    key = (F.when(F.col("payload") == "nul", F.lit("a\u0000b"))
           .when(F.col("payload") == "long", F.lit("k" * 3000))
           .when(F.col("payload") != "none", F.col("payload")))
    return {"k": df.select(*ANCHORS, key.alias("key")),
            "n": df.select(*ANCHORS, F.length("payload").cast("string").alias("key"))}


KEYED = (Topology("keyed").bolt("b", input=SPOUT, fn=keyed,
                                outputs={"k": "key string", "n": "key string"})
         .count("k", "keys").count("n", "lengths"))
BAD_KEYS = {  # (partition, offset) of records(...) -> why the key cannot be stored
    (1, 1): "sink keys: state key holds a NUL character, which PostgreSQL text cannot store",
    (2, 2): "sink keys: state key of 3000 bytes is over max_key_bytes=2000 (a PostgreSQL "
            "index entry must fit in a third of a page)",
    (0, 3): "sink keys: state key is null"}


@pytest.mark.parametrize("acker", [True, False])
def test_a_count_key_that_cannot_be_stored_fails_its_record_or_rejects_it(spark, acker):
    """The first pass aggregates before it checks keys; a bad key found on the aggregate
    sends the batch through the exact plan: with the acker the record fails whole (its
    other tuple does not count), without it the record is rejected, its other tuple counts."""
    run = run_topology(KEYED, records(spark, ["ok", "nul", "long", "none", "ok"]), attempt=1,
                       acker=acker)
    assert run.lean is not None
    deltas, rejects, failures = collect(run)
    assert deltas.get(("keys", "ok")) == 2
    if acker:
        assert failures == BAD_KEYS and rejects == {}
        assert deltas == {("keys", "ok"): 2, ("lengths", "2"): 2}
    else:
        assert rejects == BAD_KEYS and failures == {}
        assert deltas == {("keys", "ok"): 2, ("lengths", "2"): 2, ("lengths", "3"): 1,
                          ("lengths", "4"): 2}


@pytest.mark.parametrize("acker, by_root", [(True, False), (False, False), (True, True)])
def test_the_lean_first_pass_gives_what_the_exact_plan_gives(spark, acker, by_root):
    """Counts (two sinks into one state, a teed stream), rejections and a DataFrame bolt's
    failure notes: the lean plan's rows are the exact plan's, row for row."""
    def split(df):
        words = df.select(*ANCHORS, F.posexplode(F.split("payload", " ")).alias("_pos", "key"))
        return {"w": words.where(F.col("key") != "").select(
                    *ANCHORS, "_pos", "key",
                    F.when(F.col("key") == "!", F.lit("bang")).alias("_fail")),
                "x": df.where(F.col("payload") == "").select(
                    *ANCHORS, F.lit("empty").alias("error"))}

    topology = (Topology("same").bolt("s", input=SPOUT, fn=split,
                                      outputs={"w": "key string", "x": "error string"})
                .count("w", "words").count("w", "all").count("w", "words").reject("x"))
    src = records(spark, ["a b", "", "b ! c", "a a", "c"])
    run = run_topology(topology, src, attempt=1, acker=acker, by_root=by_root)
    order = ["kind", "state_name", "key", "root", "error"]

    def rows(table):
        return sorted(table.to_pylist(), key=lambda r: tuple(str(r[c]) for c in order))

    lean = run.lean.toArrow()
    assert lean.column("_bad").null_count == len(lean)
    assert rows(lean.drop_columns(["_bad"])) == rows(run.output.toArrow())
