"""Typed records from JSON lines: each line decoded against a declared schema, in C.

A source whose records are JSON objects, one per line, may declare their schema
(``LandingFolder(json_schema="url string, flaky int")``; file segments, the PostgreSQL log and
a table source, whose payloads are JSON objects, through ``JsonSchemaSource``). Its records
then reach the topology as typed columns instead of a ``payload`` string: the bolts read
``url`` and ``flaky``, and nobody calls ``from_json``. The decoding happens where the lines
are read, in the Spark task that reads them: in the JVM when the session has onceflow's jar
and the source has a JVM reader (spark_tasks/java: Jackson's streaming parser under these
rules, ``onceflow.spark.LineDecoder``), else in a Python worker with msgspec (a JSON decoder
written in C that checks types as it parses; onceflow.sources.json_arrow, which this
module's declarations do not import: a DAG parse loads no pyarrow). The two are held equal by tests
(tests/test_jvm_reader.py), and both cost well under Spark's ``from_json`` on the same lines.

**The rules** (one definition; ``reference_decode`` states it in plain Python and a property
test holds the two equal):

- A line decodes when it is one JSON value (RFC 8259, UTF-8, whitespace around it allowed; no
  byte-order mark, no ``NaN`` / ``Infinity``, no lone surrogate escape such as ``"\\ud800"``)
  and that value is an object.
- Each declared column takes the field of its exact name (the last one when a name repeats);
  an absent field and ``null`` give null. A string column takes a JSON string; a boolean
  column ``true`` or ``false``; an integer column (tinyint, smallint, int, bigint) an
  integer literal (no fraction, no exponent) within the type's range; a double column any
  number within a double's range, a float column the same rounded to 32 bits. Other fields
  are ignored (they must still be valid JSON).
- A line that breaks a rule is **corrupt**: every declared column is null and
  ``_corrupt_record`` holds the line (as Spark's PERMISSIVE JSON reader does); so does a
  document nested too deeply for the decoder (about a thousand levels).

Where Spark's JSON reader is more lenient (a number read into a string column becomes its
text, ``NaN`` is a number, what follows the first value is ignored), these rules refuse the
line instead: say what you mean in the schema, or read ``payload`` and parse it yourself.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from onceflow.core.errors import ConfigError
from onceflow.core.source import CORRUPT, PROBLEM, Source
from onceflow.core.topology import TopologyError, column_types

_INTS = {"tinyint": 8, "smallint": 16, "int": 32, "bigint": 64}  # a column's bits
_ALIASES = {"long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint",
            "bool": "boolean", "real": "float"}
TYPES = ("string", "boolean", *_INTS, "float", "double")


@dataclass(frozen=True)
class JsonRecords:
    """The declared schema of JSON-lines records (Spark DDL of simple types) and its decoder.

    ``columns``: (name, Spark type) in declaration order; ``record_ddl``: the columns the
    records carry, ``_corrupt_record`` last."""

    ddl: str
    columns: tuple[tuple[str, str], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not isinstance(self.ddl, str) or not self.ddl.strip():
            raise ConfigError(f"source.json_schema={self.ddl!r} is invalid: give the records' "
                              "fields as Spark DDL, e.g. 'url string, flaky int'")
        try:
            declared = column_types(self.ddl)
        except TopologyError as error:
            raise ConfigError(f"source.json_schema={self.ddl!r} is invalid: {error}") from None
        columns = []
        for name, kind in declared.items():
            kind = _ALIASES.get(kind, kind)
            if kind not in TYPES:
                raise ConfigError(
                    f"source.json_schema: column {name!r} is {kind}; a decoded column is one "
                    f"of {', '.join(TYPES)}: declare it as string and convert it in a bolt")
            if name in (CORRUPT, PROBLEM, "partition", "offset", "payload"):
                raise ConfigError(f"source.json_schema: column {name!r} is a name onceflow "
                                  "gives the record itself: rename it in the schema (the JSON "
                                  "field keeps its name only if you read payload instead)")
            columns.append((name, kind))
        object.__setattr__(self, "columns", tuple(columns))

    @property
    def record_ddl(self) -> str:
        return ", ".join(f"`{name}` {kind}" for name, kind in self.columns) + \
            f", {CORRUPT} string"

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.columns]

    @property
    def float_columns(self) -> list[str]:
        """The float and double columns (NaN and the infinities have no JSON form)."""
        return [name for name, kind in self.columns if kind in ("float", "double")]

    def decode(self, lines: Sequence[bytes], max_bytes: int | None = None):
        """``lines`` (UTF-8 bytes, no line ends) as Arrow arrays by these rules: the declared
        columns and ``_corrupt_record`` (a dict by name), and ``_problem``, why the spout
        refuses a line (onceflow.sources.json_arrow.decode, which the Spark side's readers
        call directly)."""
        from onceflow.sources import json_arrow  # pyarrow's: a DAG parse declares the schema only

        return json_arrow.decode(self.columns, lines, max_bytes)


@dataclass(frozen=True, kw_only=True)
class JsonSchemaSource(Source):
    """A source whose payloads may be decoded where they are read: ``json_schema``, the
    payloads' fields as Spark DDL of simple types. With it the records carry these columns
    and ``_corrupt_record`` instead of ``payload`` (by the rules of this module), the reader
    says why the spout refuses a record in ``_problem``, and the topology parses nothing.
    ``payloads`` stays the payload strings: verify and the backflow's replays decode them
    with the same ``records``."""

    json_schema: str | None = None

    def validate(self) -> None:
        super().validate()
        self.records  # noqa: B018 (compiles json_schema: a bad one fails here, by name)

    @functools.cached_property
    def records(self) -> JsonRecords | None:
        """The decoder of ``json_schema``; None: the records are payload strings."""
        return JsonRecords(self.json_schema) if self.json_schema is not None else None

    @property
    def record_ddl(self) -> str:
        return self.records.record_ddl if self.records else super().record_ddl


# --- the rules in plain Python (the property tests' reference) -----------------------------

def reference_decode(records: JsonRecords, line: bytes) -> dict | None:
    """The declared columns of ``line`` by the rules above, or None when it is corrupt,
    written with the standard library only."""
    try:
        text = line.decode("utf-8")
        doc = json.loads(text, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or _has_lone_surrogate(doc):
        return None
    out = {}
    for name, kind in records.columns:
        value = doc.get(name)
        if value is None:
            out[name] = None
        elif kind == "string":
            if type(value) is not str:
                return None
            out[name] = value
        elif kind == "boolean":
            if type(value) is not bool:
                return None
            out[name] = value
        elif kind in _INTS:
            bits = _INTS[kind]
            if type(value) is not int or not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
                return None
            out[name] = value
        else:  # float, double
            if type(value) not in (int, float):
                return None
            try:
                number = float(value)
            except OverflowError:
                return None
            if not math.isfinite(number):
                return None
            out[name] = number
    return out


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False
