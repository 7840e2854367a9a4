"""A run's outputs, collected: the OUTPUT rows as one Arrow table, and the Python values made
from it (Collected, split)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from onceflow.core.tables import Shape

# What a topology's run yields, one row per output; ``kind``: 0 delta, 1 rejected record,
# 2 failed record (for the backflow), 3 state change of a stateful bolt.
DELTA, REJECT, FAILED, CHANGE = 0, 1, 2, 3
OUTPUT = ("kind int, state_name string, key string, delta long, partition int, offset long, "
          "replayed boolean, error string, bolt string, namespace string, value string, "
          "root long")


def pa_array(values: list):
    return pa.array(values, pa.string())

@dataclass
class Collected:
    """A run's outputs, collected: ``table`` (the OUTPUT rows, Arrow), and as Python values
    deltas {(state, key): delta} (or {(state, key, root)} by root), rejected {(partition,
    offset): error}, failed {(partition, offset, replayed): error}, state changes {bolt:
    [(namespace, key, JSON value or None)]}. The deltas by (state, key) and the rejects are
    made from the table when first asked for: staging reads the table, and a state of a
    million keys would otherwise cost a million Python tuples per batch."""

    table: object
    _rejected: dict | None  # made from the table when first asked for (rejected)
    failed: dict
    changes: dict
    seconds: float = 0.0
    tables: dict = field(default_factory=dict)  # typed state -> Arrow rows (typed_rows)
    _deltas: dict | None = None  # made when first asked for; set by split when by root

    @property
    def rejected(self) -> dict:
        if self._rejected is None:  # a record rejected for two reasons: the least, as ever
            table = self.table
            rows = table.filter(pc.equal(table.column("kind"), REJECT))
            self._rejected = {}
            for position, error in zip(zip(rows.column("partition").to_pylist(),
                                           rows.column("offset").to_pylist(), strict=True),
                                       rows.column("error").to_pylist(), strict=True):
                if position not in self._rejected or error < self._rejected[position]:
                    self._rejected[position] = error
        return self._rejected

    @property
    def deltas(self) -> dict:
        if self._deltas is not None:
            return self._deltas
        table = self.table
        deltas = table.filter(pc.equal(table.column("kind"), DELTA))
        keys = zip(deltas.column("state_name").to_pylist(), deltas.column("key").to_pylist(),
                   strict=True)
        self._deltas = dict(zip(keys, deltas.column("delta").to_pylist(), strict=True))
        return self._deltas


def rows_like(schema, columns: Mapping[str, object]):
    """Output rows made in Python (Arrow arrays by column) with ``schema``: the other
    columns null."""
    n = len(next(iter(columns.values())))
    return pa.table({f.name: columns[f.name].cast(f.type) if f.name in columns
                     else pa.nulls(n, f.type) for f in schema}, schema=schema)


def typed_rows(table, shapes: Mapping[str, Shape], by_root: bool = False) -> dict:
    """Each typed state's rows in an OUTPUT table: Arrow tables with the state's staging
    columns (and ``root``, by_root)."""

    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        rows = table.filter(pc.and_(pc.equal(table.column("kind"), DELTA),
                                    pc.equal(table.column("state_name"), name)))
        names = [c for c, _ in shape.staged()]
        picked = rows.select([f"_t{i}_{c}" for c in names] + (["root"] if by_root else []))
        out[name] = picked.rename_columns(names + (["root"] if by_root else []))
    return out


def split(table, by_root: bool = False, seconds: float = 0.0,
          shapes: Mapping[str, Shape] | None = None) -> Collected:
    """An OUTPUT table as Python values (see Collected)."""

    out = Collected(table, None, {}, {}, seconds)
    if shapes:
        out.tables = typed_rows(table, shapes, by_root)
        table = table.filter(pc.invert(pc.fill_null(pc.is_in(
            table.column("state_name"), pa_array(list(shapes))), False)))
        out.table = table
    # rejects: made from the table when asked for (a batch may have thousands; staging reads
    # the table)
    small = table.filter(pc.is_in(table.column("kind"), pa.array(
        (DELTA, FAILED, CHANGE) if by_root else (FAILED, CHANGE), pa.int32())))
    if by_root:
        out._deltas = {}
    for row in small.to_pylist():
        kind = row["kind"]
        if kind == DELTA:
            k = (row["state_name"], row["key"], row["root"])
            out._deltas[k] = out._deltas.get(k, 0) + row["delta"]
        elif kind == FAILED:
            out.failed[(row["partition"], row["offset"], row["replayed"])] = row["error"]
        elif kind == CHANGE:
            out.changes.setdefault(row["bolt"], []).append(
                (row["namespace"], row["key"], row["value"]))
    return out
