"""The types a typed table's columns may have: how onceflow spells them, their Spark types,
and which stream columns they hold without loss."""

from __future__ import annotations

import re

NUMERIC = re.compile(r"^numeric\((\d{1,2}),\s*(\d{1,2})\)$")
# PostgreSQL type -> Spark type, for keys and for min / max / last values
_TYPES = {
    "text": "string", "bigint": "bigint", "integer": "int", "smallint": "smallint",
    "boolean": "boolean", "date": "date", "timestamp": "timestamp_ntz",
    "timestamptz": "timestamp", "double precision": "double",
}
SUMMABLE = ("bigint", "integer", "smallint", "double precision")  # and numeric(p,s)


# Spark's JSON of a row (typed tuples through the verdict, Parquet rows as payloads):
# timestamps keep their microseconds.
SPARK_JSON = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
              "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS"}


def spark_type(pg_type: str) -> str:
    match = NUMERIC.match(pg_type)
    if match:
        return f"decimal({match.group(1)},{match.group(2)})"
    return _TYPES[pg_type]


def normal_type(pg_type: str) -> str:
    """A type as onceflow spells it ('int8' and 'long' are not accepted: one spelling)."""
    text = " ".join(str(pg_type).lower().split())
    return re.sub(r"numeric\(\s*(\d+)\s*,\s*(\d+)\s*\)", r"numeric(\1,\2)", text)


def known_type(pg_type: str) -> bool:
    match = NUMERIC.match(pg_type)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        return 1 <= precision <= 38 and scale <= precision
    return pg_type in _TYPES


TYPE_HELP = ("use one of text, bigint, integer, smallint, boolean, date, timestamp, "
             "timestamptz, double precision, numeric(p,s) (p up to 38)")

INTEGERS = ("smallint", "integer", "bigint")
_SPARK_INTEGRAL = ("tinyint", "smallint", "int", "bigint")
_SPARK_SIMPLE = (*_SPARK_INTEGRAL, "string", "boolean", "float", "double", "decimal", "date",
                 "timestamp", "timestamp_ntz")
_DECIMAL = re.compile(r"^decimal(?:\((\d+)\s*(?:,\s*(\d+))?\))?$")


def conversion_loss(kind: str, pg_type: str) -> str | None:
    """Why a stream column of Spark type ``kind`` (onceflow.core.topology.column_types'
    spelling) cannot be stored as ``pg_type`` without losing what every value holds, or None.

    A string is parsed per record; a value out of the type's range (1780.25 in a
    numeric(5,2)) is that record's failure, not the declaration's. What is refused here
    would change every value silently: a fraction cut off (2.7 into an integer), decimals
    rounded away (numeric(12,4) into numeric(12,2)), a time of day dropped (timestamp into
    date), or types that do not convert at all (boolean into a number)."""
    base = kind.split("(")[0].split("<")[0].strip()
    if base == "string":
        return None
    if base not in _SPARK_SIMPLE:
        return f"a {kind} column cannot be stored in a table column: convert it in a bolt"
    if pg_type == "text":
        return None
    numeric = NUMERIC.match(pg_type)
    if base in ("float", "double", "decimal") and pg_type in INTEGERS:
        decimal = _DECIMAL.match(kind)
        if base != "decimal" or (decimal and int(decimal.group(2) or 0) > 0):
            return "the fraction of every value would be cut off"
    if base == "decimal" and numeric:
        decimal = _DECIMAL.match(kind)
        scale, want = int((decimal and decimal.group(2)) or 0), int(numeric.group(2))
        if scale > want:
            return f"its {scale} decimal places would be rounded to {want}"
    if base in ("timestamp", "timestamp_ntz") and pg_type == "date":
        return "the time of day would be cut off"
    numbers = (*INTEGERS, "double precision")
    fits = {"boolean": ("boolean",), "date": ("date", "timestamp", "timestamptz"),
            "timestamp": ("timestamp", "timestamptz"),
            "timestamp_ntz": ("timestamp", "timestamptz")}
    if base in fits:
        ok = pg_type in fits[base]
    else:  # a number
        ok = pg_type in numbers or bool(numeric)
    return None if ok else f"a {kind} column does not convert to {pg_type}"
