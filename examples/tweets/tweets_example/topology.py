"""The tweets example's topology: tweet -> url tuple and domain tuple -> counts.

    records --parse (JVM)--> urls ----------------------------------> count url_counts
                                 (tweets_first_seen: urls --first_seen--> count new_urls)
                        \\--> domains --normalize_domain (Python)--> count domain_counts
                        \\--> rejects ------------------------------> rejected records

``parse`` is a DataFrame bolt (JSON parsing and URL checks as Spark expressions); a tweet it
cannot use goes to the rejects stream. ``topology_typed`` is the same topology for a source
that decodes the tweets itself (a landing folder with ``json_schema=SCHEMA``): its parse bolt
reads ``url`` and ``flaky`` instead of calling ``from_json``. ``normalize_domain`` is a
per-record Python bolt that fails on a host IDNA refuses, so its record's URL tuple, already
counted by the other branch, is dropped with it: a record counts fully or not at all, and is
replayed from the backflow queues. Its pure-Python twin, tweets_example.data.recount,
recounts the same result independently (``onceflow verify --recount``, and the tests'
oracle).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow import ANCHORS, SPOUT, StatefulBolt, Topology
from tweets_example.data import (
    ERR_BAD_URL,
    ERR_MALFORMED,
    ERR_NO_URL,
    URL_HOST,
    normalize_domain,
)

# The tweet's fields the topology reads (a source's json_schema; a wrongly typed flaky makes the
# tweet malformed)
SCHEMA = "url string, flaky int"
_SCHEMA = f"{SCHEMA}, _corrupt_record string"
# tweets_example.data.parse_event states the same definition in Python.
_JSON_OPTIONS = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record",
                 "allowSingleQuotes": "false"}


def parse(records: DataFrame) -> DataFrame:
    """The input's columns but payload, plus url, domain, flaky, error (null: usable)."""
    doc = F.from_json("payload", _SCHEMA, _JSON_OPTIONS)
    # (withColumns and drop rather than a select of the input's columns: no schema look-up,
    # which is a round trip to the server under Spark Connect)
    parsed = records.withColumn("j", doc).withColumns({
        "url": F.col("j.url"),
        "domain": F.lower(F.regexp_extract("j.url", URL_HOST, 1)),
        "flaky": F.col("j.flaky"),
        "corrupt": F.col("j._corrupt_record"),
    }).drop("payload", "j")
    error = (
        F.when(F.col("corrupt").isNotNull(), F.lit(ERR_MALFORMED))
        .when(F.col("url").isNull(), F.lit(ERR_NO_URL))
        .when(F.col("domain") == "", F.lit(ERR_BAD_URL))
    )
    return parsed.withColumn("error", error).drop("corrupt")


def classify_typed(records: DataFrame) -> DataFrame:
    """``parse`` for decoded tweets (url, flaky, _corrupt_record): the same columns out."""
    # The domain in a step of its own, which the error then reads: written in one select,
    # the regex would run twice per tweet (Spark does not share an expression between a
    # column and a CASE branch that is evaluated only sometimes).
    parsed = records.select(*ANCHORS, "url", F.lower(F.regexp_extract("url", URL_HOST, 1))
                            .alias("domain"), "flaky", "_corrupt_record")
    error = (
        F.when(F.col("_corrupt_record").isNotNull(), F.lit(ERR_MALFORMED))
        .when(F.col("url").isNull(), F.lit(ERR_NO_URL))
        .when(F.col("domain") == "", F.lit(ERR_BAD_URL))
    )
    return parsed.select(*ANCHORS, "url", "domain", "flaky", error.alias("error"))


def _parse_bolt(parse=parse):
    def bolt(records: DataFrame) -> DataFrame:
        parsed = parse(records)
        null_s, null_i = F.lit(None).cast("string"), F.lit(None).cast("int")

        def tuple_(stream, key=null_s, host=null_s, flaky=null_i, error=null_s):
            return F.struct(F.lit(stream).alias("_stream"), key.alias("key"),
                            host.alias("host"), flaky.alias("flaky"), error.alias("error"))

        out = F.when(F.col("error").isNull(), F.array(
            tuple_("urls", key=F.col("url")),
            tuple_("domains", host=F.col("domain"), flaky=F.col("flaky")),
        )).otherwise(F.array(tuple_("rejects", error=F.col("error"))))
        return parsed.select(*ANCHORS, F.explode(out).alias("t")).select(*ANCHORS, "t.*")

    return bolt


def topology(pipeline=None, parse=parse) -> Topology:
    return (
        Topology("tweets")
        .bolt("parse", input=SPOUT, fn=_parse_bolt(parse), outputs={
            "urls": "key string",
            "domains": "host string, flaky int",
            "rejects": "error string",
        })
        .record_bolt("normalize_domain", input="domains", fn=normalize_domain,
                     outputs={"domain_keys": "key string"})
        .count("urls", "url_counts")
        .count("domain_keys", "domain_counts")
        .reject("rejects")
    )


def topology_typed(pipeline=None) -> Topology:
    """The topology for a source that decodes the tweets (``json_schema=SCHEMA``)."""
    return topology(pipeline, parse=classify_typed)


class FirstSeen(StatefulBolt):
    """First-seen detection: emits a URL the first time it is ever seen, across batches.

    State: URL -> the txid that saw it first (sharded by URL). Exactly once: the state and
    the emitted tuple count only with the transaction, and only if the record's whole tree
    completed, so a replayed or re-attempted batch never emits a URL a second time.
    """

    def init_state(self, state) -> None:
        self.state = state

    def execute(self, values: dict) -> list[dict]:
        url = values["key"]
        if self.state.get(url) is not None:
            return []
        self.state.put(url, True)
        return [{"key": url}]


def topology_first_seen(pipeline=None) -> Topology:
    """The demo topology plus a stateful bolt: urls --first_seen--> new_urls (counted, so
    each URL must end with exactly 1)."""
    return (
        topology(pipeline)
        .stateful_bolt("first_seen", input="urls", key="key", bolt=FirstSeen(),
                       outputs={"new_urls": "key string"})
        .count("new_urls", "new_urls")
    )
