"""Orders' amounts per merchant: a JSON parse bolt in the JVM, a sink, rejects.

    records --parse--> orders -> <pipeline>_totals
                  \\--> bad ---> rejected records
"""

from pyspark.sql import functions as F

from onceflow import ANCHORS, SPOUT, Topology

ORDER = "merchant string, amount decimal(12,2)"


def parse(records):
    o = F.from_json("payload", ORDER).alias("o")
    d = records.select(*ANCHORS, o).select(*ANCHORS, "o.*")
    ok = F.col("merchant").isNotNull() & F.col("amount").isNotNull()
    return d.select(*ANCHORS, F.when(ok, F.lit("orders")).otherwise(F.lit("bad")).alias("_stream"),
                    "merchant", "amount",
                    F.when(ok, F.lit(None)).otherwise(F.lit("not an order")).alias("error"))


def _parsed() -> Topology:
    return Topology("amounts").bolt("parse", input=SPOUT, fn=parse,
                                    outputs={"orders": ORDER, "bad": "error string"})


def build(pipeline=None) -> Topology:
    return _parsed().sink("orders", "totals").reject("bad")


def with_fees(pipeline=None) -> Topology:
    """A second stream whose ``amount`` is a double: one column name with two types."""
    def fees(df):
        return df.select(*ANCHORS, "merchant", (F.col("amount") / 100).cast("double")
                         .alias("amount"))

    return (_parsed().bolt("fees", input="orders", fn=fees,
                           outputs={"fees": "merchant string, amount double"})
            .sink("fees", "totals").reject("bad"))
