"""The SELECTs that make a table source's records: partition 0, the key as the offset, and the
payload.

A record's payload: the row as JSON (``row_to_json(t)``), or with json_schema the JSON object
of the declared columns the table has (``row_to_json`` of a sub-select of them). Batches,
payloads, payloads_at (the backflow) and verify all build it here, so the decoder,
``_corrupt_record`` and ``max_record_bytes`` see one payload wherever a record is read.
Values go in as literals: an identifier may hold a ``%``, which parameters would take for a
placeholder.

**The direct read.** When every declared column the table has is of a type whose COPY text
Arrow parses to exactly what the decoder makes of its JSON (check.DIRECT: text, varchar or
char declared string; an integer declared an integer at least as wide; boolean; real
declared float or double; double precision or numeric declared double), a batch copies the
values themselves and builds no JSON, except for the rows the decoder must judge: a NaN or
an infinity (JSON strings, so corrupt), a numeric past a double's range or tiny, and a row
whose payload may be over ``max_record_bytes`` by a cheap upper bound. Those carry their
payload and are decoded; the others are yielded as read. Any other declared column (a
timestamp declared string, json, a narrower integer) keeps the whole source on decoding
every payload (``TableSource.direct`` says which).
"""

from __future__ import annotations

from psycopg2 import sql

from onceflow.sources.table.check import STRINGS, CheckedTable

# the most bytes to_json writes for a value of these types (a bigint's minimum, a double's
# shortest text that reads back the same), "null" included
_WIDTH = {"boolean": 5, "smallint": 6, "integer": 11, "bigint": 20, "real": 26,
          "double precision": 26}


def rows(table: CheckedTable, where: sql.Composable) -> sql.Composed:
    """``FROM`` the table as ``t`` (and its declared columns as ``r``) ``WHERE where``."""
    if table.fields is None:
        return sql.SQL("FROM {} AS t WHERE {}").format(table.name, where)
    picked = sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(f.name))
                                for f in table.present)
    return sql.SQL("FROM {} AS t CROSS JOIN LATERAL (SELECT {}) AS r WHERE {}").format(
        table.name, picked, where)


def payload(table: CheckedTable) -> sql.SQL:
    # t.* and r.*: a bare t or r would name a column of the table called so
    return sql.SQL("row_to_json(t.*)::text" if table.fields is None
                   else "row_to_json(r.*)::text")


def keys(table: CheckedTable, start: int, end: int) -> sql.Composed:
    """The rows of keys ``[start, end)``."""
    return sql.SQL("t.{key} >= {start} AND t.{key} < {end}").format(
        key=table.key, start=sql.Literal(start), end=sql.Literal(end))


def payload_select(table: CheckedTable, start: int, end: int) -> sql.Composed:
    """The records of keys ``[start, end)``: partition, offset, payload."""
    return sql.SQL("""SELECT 0 AS partition, t.{key}::bigint AS "offset", {payload}
                      AS payload {rows}""").format(
        key=table.key, payload=payload(table), rows=rows(table, keys(table, start, end)))


def direct_select(table: CheckedTable, start: int, end: int, max_record_bytes: int
                  ) -> sql.Composed:
    """The records of keys ``[start, end)`` read directly (``table.direct``): partition,
    offset, the declared columns the table has, as stored (no cast: a real read as a
    double must keep its own shortest text, a bpchar its padding), then ``payload``:
    NULL for a clean row, the payload for a row the decoder must judge: a NaN or an
    infinity (to_json writes them as strings, which a number column refuses), a numeric
    past a double's range or a tiny one (whose sign a zero may keep), or one whose
    payload may exceed max_record_bytes by a cheap upper bound (6 bytes a text byte,
    the widest text of a fixed-width type)."""
    values, suspect = [], []
    size = 2 + len(table.present)  # braces and commas (one more than needed)
    variable = []
    for field in table.present:
        pg_type = field.pg_type
        column = sql.SQL("t.{}").format(sql.Identifier(field.name))
        size += 6 * len(field.name.encode()) + 3  # the key, escaped, quoted, and its colon
        if pg_type in ("real", "double precision", "numeric"):
            fine = (sql.SQL("abs({c}) < 'Infinity'") if pg_type != "numeric" else sql.SQL(
                "abs({c}) < 1e308 AND ({c} = 0 OR abs({c}) > 1e-300)")).format(c=column)
            values.append(sql.SQL("CASE WHEN {} THEN {} END").format(fine, column))
            suspect.append(sql.SQL("coalesce(NOT ({}), false)").format(fine))
        else:
            values.append(column)
        if pg_type in STRINGS:
            size += 4
            variable.append(sql.SQL("6 * coalesce(octet_length({}), 0)").format(column))
        elif pg_type == "numeric":  # below 1e308: 309 digits, a sign and a point at most
            size += 311
            variable.append(sql.SQL("coalesce(scale({}), 0)").format(column))
        else:
            size += _WIDTH[pg_type]
    if variable:
        suspect.append(sql.SQL("{} > {}").format(
            sql.SQL(" + ").join([sql.Literal(size), *variable]),
            sql.Literal(max_record_bytes)))
    elif size > max_record_bytes:
        suspect.append(sql.SQL("true"))
    judged = sql.SQL("CASE WHEN {} THEN {} END").format(
        sql.SQL(" OR ").join(suspect), payload(table)) if suspect else sql.SQL("NULL::text")
    return sql.SQL("""SELECT 0 AS partition, t.{key}::bigint AS "offset", {values}
                      {payload} AS payload {rows}""").format(
        key=table.key, values=sql.SQL("").join(sql.SQL("{}, ").format(v) for v in values),
        payload=judged, rows=rows(table, keys(table, start, end)))
