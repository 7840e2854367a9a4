"""The Spark side: a JVM parse bolt, a per-record Python bolt that refuses unknown countries.

    records --parse--> views --country (Python)--> by_country -> views_per_country
                  \\                            \\-> by_page ----> views_per_page
                   \\--> bad ---------------------------------> rejected records
"""

from pyspark.sql import functions as F

from onceflow import ANCHORS, SPOUT, Topology

UNKNOWN = "ZZ"  # a country code the lookup refuses: such views fail, every time


class UnknownCountry(ValueError):
    pass


def parse(records):
    doc = F.from_json("payload", "country string, page string, _corrupt string",
                      {"columnNameOfCorruptRecord": "_corrupt"})
    parsed = records.select(*ANCHORS, doc.alias("d"))
    ok = F.col("d._corrupt").isNull() & F.col("d.country").isNotNull() \
        & F.col("d.page").isNotNull()
    return parsed.select(
        *ANCHORS,
        F.when(ok, F.lit("views")).otherwise(F.lit("bad")).alias("_stream"),
        F.col("d.country").alias("country"), F.col("d.page").alias("page"),
        F.when(ok, F.lit(None)).otherwise(F.lit("not a page view")).alias("error"))


def country(values):
    if values["country"] == "hold":  # the tests' way to catch a batch in the middle
        import time
        from pathlib import Path

        Path(values["page"] + ".reached").touch()
        deadline = time.time() + 300
        while not Path(values["page"]).exists() and time.time() < deadline:
            time.sleep(0.1)
    code = values["country"].strip().upper()
    if code == UNKNOWN:
        raise UnknownCountry(f"unknown country {values['country']!r}")
    return [("by_country", {"key": code}), ("by_page", {"key": values["page"]})]


def build(pipeline=None):
    return (
        Topology("page_views")
        .bolt("parse", input=SPOUT, fn=parse,
              outputs={"views": "country string, page string", "bad": "error string"})
        .record_bolt("country", input="views", fn=country,
                     outputs={"by_country": "key string", "by_page": "key string"})
        .count("by_country", "views_per_country")
        .count("by_page", "views_per_page")
        .reject("bad")
    )
