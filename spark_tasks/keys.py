"""Why a sink tuple's key, or a typed tuple's values, cannot be stored in PostgreSQL: the
checks a tuple passes before it counts (a key that would break staging fails its record
instead of its batch), as Spark column expressions that are null when all is well."""

from __future__ import annotations

from pyspark.sql import functions as F

from onceflow.core.tables import Shape, spark_type


def bad_text(key, what: str, limit: int):
    """Why a text key PostgreSQL cannot store or index fails its record (else null)."""
    return (F.when(key.isNull(), F.lit(f"{what} is null"))
            .when(key.contains("\u0000"),
                  F.lit(f"{what} holds a NUL character, which PostgreSQL text cannot "
                        "store"))
            .when(F.octet_length(key) > limit,
                  F.concat(F.lit(f"{what} of "), F.octet_length(key).cast("string"),
                           F.lit(f" bytes is over max_key_bytes={limit} (a PostgreSQL "
                                 "index entry must fit in a third of a page)"))))


def bad_key(limit: int, shape: Shape | None = None):
    """Why a tuple's key, or a typed tuple's values, cannot be stored (else null): a
    record that would break staging, or one whose value its declared type cannot hold
    (1780.25 in a numeric(5,2)), fails alone instead of failing its batch for ever,
    named with its table, column, value and type. The first reason in the declaration's
    order is the record's."""
    if shape is None:
        return bad_text(F.col("key").cast("string"), "state key", limit)
    keys = {c for c, _ in shape.key}
    checked: set[str] = set()
    reasons = []
    for column, pg_type, whats in shape.typed_inputs():
        value = F.col(column)
        if column in keys and column not in checked:
            reasons.append(bad_text(value.cast("string"), f"key column {column}", limit)
                           if pg_type == "text" else
                           F.when(value.isNull(), F.lit(f"key column {column} is null")))
        elif pg_type == "text":
            reasons.append(F.when(value.cast("string").contains("\u0000"), F.lit(
                f"column {column} holds a NUL character, which PostgreSQL text cannot "
                "store")))
        checked.add(column)
        if pg_type != "text":  # the value fits the declared type (numeric(p,s): digits)
            reasons.append(F.when(
                value.isNotNull() & value.try_cast(spark_type(pg_type)).isNull(),
                F.concat(F.lit(f"{' and '.join(whats)}: value "), value.cast("string"),
                         F.lit(f" does not fit {pg_type}"))))
    return F.coalesce(*reasons) if reasons else F.lit(None).cast("string")
