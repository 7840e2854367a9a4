"""A typed state's tuples through the run (onceflow.core.tables.Shape): each passes the verdict
as one JSON text in ``key``, like a count state's key (typed_row), and is decoded into the
state's own columns where the deltas are summed (decode_typed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from onceflow.core.tables import ORDER, SPARK_JSON, Shape, spark_type
from onceflow.spark.collected import DELTA

# Typed tuples travel as JSON through the verdict (timestamps keep their microseconds).
JSON_OPTIONS = SPARK_JSON


def _rank(order_by: str | None, cols: Mapping[str, str]):
    """What orders a typed state's Last measures, as a bigint: the ``order_by`` column
    (a number, a date's day, a timestamp's microsecond), else the record's root id."""
    if order_by is None:
        return F.col("_root")
    kind = cols[order_by]
    column = F.col(order_by)
    if kind == "date":
        return F.unix_date(column).cast("bigint")
    if kind.startswith("timestamp"):
        return F.unix_micros(column.cast("timestamp"))
    return column.cast("bigint")


def typed_row(shape: Shape, cols: Mapping[str, str]):
    """A typed state's tuple as one JSON text (its inputs and its order), which passes
    the verdict like a count state's key; decode_typed decodes it."""
    fields = [F.col(c) for c in shape.inputs()]
    if shape.ordered:
        fields.append(_rank(shape.order_by, cols).alias(ORDER))
    return F.to_json(F.struct(*fields), JSON_OPTIONS)


class Decoded(NamedTuple):
    """decode_typed's result: the rows to aggregate, the aggregations (the deltas' sum and
    every typed measure), whether a row belongs to an append table (its identical rows are
    copied back after the aggregation), and the names of the typed states' columns."""

    rows: DataFrame
    aggs: list
    appended: object
    columns: list[str]


def decode_typed(shapes: Mapping[str, Shape], cols: Mapping[str, str],
                 rows: DataFrame, aggs: list) -> Decoded:
    """Each typed state's JSON tuples decoded into its columns, ``key`` replaced by its
    key columns' JSON (what the aggregation groups by), and the aggregations of its
    measures (see onceflow.core.tables: sum, count, min, max, last), and the names of
    the columns these aggregations give."""
    decoded, key = [], F.col("key")
    appended = F.lit(False)
    for i, (name, shape) in enumerate(shapes.items()):
        mine = (F.col("kind") == DELTA) & (F.col("state_name") == name)
        schema = ", ".join(f"`{c}` {cols[c]}" for c in shape.inputs())
        if shape.ordered:
            schema += f", `{ORDER}` bigint"
        decoded.append(F.when(mine, F.from_json("key", schema, JSON_OPTIONS)).alias(f"_j{i}"))
        if shape.append:
            appended = appended | (F.col("state_name") == name)
    rows = rows.select("*", *decoded)  # parsed once per row, then read by column
    keyed = []
    names: list[str] = []
    for i, (name, shape) in enumerate(shapes.items()):
        j = F.col(f"_j{i}")

        def col(column: str, pg_type: str, j=j):
            return j[column].cast(spark_type(pg_type))

        def out(column: str, i=i) -> str:
            return f"_t{i}_{column}"

        if shape.append:
            keyed += [col(c, t).alias(out(c)) for c, t in shape.columns]
            aggs += [F.first(out(c)).alias(out(c)) for c, _ in shape.columns]
            names += [out(c) for c, _ in shape.columns]
            continue
        keyed += [col(c, t).alias(out(c)) for c, t in shape.key]
        aggs += [F.first(out(c)).alias(out(c)) for c, _ in shape.key]
        names += [out(c) for c, _ in shape.key]
        key = F.when(F.col("state_name") == name, F.to_json(F.struct(
            *[j[c] for c, _ in shape.key]), JSON_OPTIONS)).otherwise(key)
        for measure_name, measure in shape.measures:
            if measure.column:
                keyed.append(col(measure.column, measure.type).alias(out(measure_name)))
            stored = spark_type(measure.staged_type())
            value = F.col(out(measure_name))
            if measure.agg == "sum":
                agg = F.sum(value * F.col("delta")).cast(stored)
            elif measure.agg == "count":
                agg = F.sum(F.col("delta") if measure.column is None
                            else F.when(value.isNotNull(), F.col("delta")).otherwise(0))
                agg = agg.cast("bigint")
            elif measure.agg in ("min", "max"):
                agg = getattr(F, measure.agg)(value)
            else:
                agg = F.max_by(value, F.col(out(ORDER)))
            aggs.append(agg.alias(out(measure_name)))
            names.append(out(measure_name))
        if shape.ordered:
            keyed.append(j[ORDER].alias(out(ORDER)))
            aggs.append(F.max(out(ORDER)).alias(out(ORDER)))
            names.append(out(ORDER))
    rows = rows.select("kind", "state_name", key.alias("key"), "root", "error", "delta",
                       *keyed)
    return Decoded(rows, aggs, appended, names)
