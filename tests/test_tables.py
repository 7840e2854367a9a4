"""Typed tables (onceflow.core.tables) on a real PostgreSQL: composite typed keys, several
measures with their previous values, upsert and append tables, applied the way the commit
applies them, replays included. The Spark side and the whole path are in test_orders.py."""

from __future__ import annotations

import io
import random
import re
from datetime import date
from decimal import Decimal

import pytest
from psycopg2 import sql

from onceflow import Count, Last, Max, Min, StateSpec, Sum
from onceflow.core import db, tables
from onceflow.core.errors import ConfigError, StaleBatch, StateOverflow
from onceflow.core.pipeline import Pipeline
from onceflow.sources.pglog import PostgresLog

REVENUE = StateSpec("revenue", key={"merchant": "text", "day": "date"}, measures={
    "total": Sum("amount", "numeric(12,2)"), "orders": Count(),
    "largest": Max("amount", "numeric(12,2)"), "smallest": Min("amount", "numeric(12,2)")})
FACTS = StateSpec.append("facts", columns={"order_id": "bigint", "amount": "numeric(12,2)"})
LATEST = StateSpec.upsert("latest", key={"merchant": "text"},
                          columns={"order_id": "bigint"}, order_by="order_id")


def batch(cur, shape, rows) -> sql.Composable:
    """A batch as the staging would give it: a temporary table with staged_batch's columns."""
    name = f"batch_{shape.name}"
    cols = [(c, t) for c, t in shape.staged() if c != tables.ORDER]
    cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
    columns = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in cols)
    cur.execute(sql.SQL("CREATE TEMP TABLE {} ({})").format(sql.Identifier(name), columns))
    for row in rows:
        cur.execute(sql.SQL("INSERT INTO {} VALUES ({})").format(
            sql.Identifier(name), sql.SQL(", ").join(sql.Placeholder() * len(row))), row)
    return sql.SQL("SELECT * FROM {}").format(sql.Identifier(name))


def apply(conn, spec: StateSpec, txid: int, rows, **kw) -> int:
    with db.transaction(conn) as cur:
        tables.ensure_table(cur, spec.shape(), spec.opaque, with_txid_index=True)
        return tables.apply_batch(cur, spec.shape(), spec.opaque, txid,
                                  batch(cur, spec.shape(), rows), **kw)


def rows_of(conn, query: str) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(query)
        out = cur.fetchall()
    conn.commit()
    return out


def aggregate(orders):
    """(merchant, day) -> [total, orders, largest, smallest], in Python."""
    out = {}
    for merchant, day, amount in orders:
        t = out.setdefault((merchant, day), [Decimal(0), 0, amount, amount])
        t[0] += amount
        t[1] += 1
        t[2], t[3] = max(t[2], amount), min(t[3], amount)
    return out


def as_rows(agg):
    return [(m, d, *v) for (m, d), v in agg.items()]


def test_numeric_sums_are_exact_to_the_cent_across_replays(conn):
    rng = random.Random(3)
    orders = [(f"m{rng.randrange(5)}", date(2026, 11, rng.randrange(1, 4)),
               Decimal(rng.randrange(1, 10**7)) / 100) for _ in range(3000)]
    first, second = orders[:1500], orders[1500:]
    apply(conn, REVENUE, 1, as_rows(aggregate(first)))
    # txid 2 is applied, then replayed with a batch that changed (an opaque re-plan): the
    # replay starts again from the values before txid 2, so only the second batch counts
    changed = second[:700]
    apply(conn, REVENUE, 2, as_rows(aggregate(second)), revert_absent=True)
    apply(conn, REVENUE, 2, as_rows(aggregate(changed)), revert_absent=True)
    want = aggregate(first + changed)
    got = {(m, d): [t, n, hi, lo] for m, d, t, n, hi, lo in rows_of(
        conn, "SELECT merchant, day, total, orders, largest, smallest FROM revenue")}
    assert got == want
    assert sum(v[0] for v in got.values()) == sum(a for _, _, a in first + changed)


def test_min_and_max_forget_a_failed_first_try(conn):
    """A first try of txid 2 wrote a maximum (and a key) that its replay does not have: the
    replay puts the key's values back, and removes the key it made."""
    apply(conn, REVENUE, 1, [("a", date(2026, 1, 1), Decimal("10.00"), 1, Decimal("10.00"),
                              Decimal("10.00"))])
    apply(conn, REVENUE, 2, [("a", date(2026, 1, 1), Decimal("999.99"), 1, Decimal("999.99"),
                              Decimal("999.99")),
                             ("new", date(2026, 1, 1), Decimal("5.00"), 1, Decimal("5.00"),
                              Decimal("5.00"))], revert_absent=True)
    apply(conn, REVENUE, 2, [("b", date(2026, 1, 2), Decimal("1.50"), 1, Decimal("1.50"),
                              Decimal("1.50"))], revert_absent=True)
    got = rows_of(conn, "SELECT merchant, total, orders, largest, smallest, txid FROM revenue "
                        "ORDER BY 1")
    assert got == [("a", Decimal("10.00"), 1, Decimal("10.00"), Decimal("10.00"), 1),
                   ("b", Decimal("1.50"), 1, Decimal("1.50"), Decimal("1.50"), 2)]
    # and a replay that has the key again starts from the values before txid 2
    apply(conn, REVENUE, 2, [("a", date(2026, 1, 1), Decimal("3.00"), 1, Decimal("3.00"),
                              Decimal("3.00"))], revert_absent=True)
    assert rows_of(conn, "SELECT total, orders, largest, smallest FROM revenue "
                         "WHERE merchant = 'a'") == [(Decimal("13.00"), 2, Decimal("10.00"),
                                                      Decimal("3.00"))]


def test_an_older_batch_is_refused_and_a_transactional_replay_skipped(conn):
    apply(conn, REVENUE, 5, [("a", date(2026, 1, 1), Decimal(1), 1, Decimal(1), Decimal(1))])
    with pytest.raises(StaleBatch, match="newer than 4"):
        apply(conn, REVENUE, 4, [("a", date(2026, 1, 1), Decimal(1), 1, Decimal(1),
                                  Decimal(1))])
    counts = StateSpec("counts", kind="transactional", key={"k": "bigint"},
                       measures={"n": Count()})
    assert apply(conn, counts, 1, [(7, 3)]) == 1
    assert apply(conn, counts, 1, [(7, 3)]) == 0  # applied before: skipped
    apply(conn, counts, 2, [(7, 4)])
    assert rows_of(conn, "SELECT k, n, txid FROM counts") == [(7, 7, 2)]


def test_an_append_table_keeps_one_copy_per_txid(conn):
    apply(conn, FACTS, 1, [(1, Decimal("1.10")), (2, Decimal("2.20"))])
    apply(conn, FACTS, 2, [(3, Decimal("3.30"))])
    apply(conn, FACTS, 2, [(3, Decimal("3.30")), (4, Decimal("4.40"))])  # a replay of txid 2
    apply(conn, FACTS, 2, [(3, Decimal("3.30")), (4, Decimal("4.40"))])  # and again
    assert rows_of(conn, "SELECT txid, order_id, amount FROM facts ORDER BY 2") == [
        (1, 1, Decimal("1.10")), (1, 2, Decimal("2.20")), (2, 3, Decimal("3.30")),
        (2, 4, Decimal("4.40"))]


def test_an_upsert_table_holds_the_latest_batch_row(conn):
    apply(conn, LATEST, 1, [("a", 1), ("b", 2)])
    apply(conn, LATEST, 2, [("a", 9)])
    assert rows_of(conn, "SELECT merchant, order_id, txid FROM latest ORDER BY 1") == [
        ("a", 9, 2), ("b", 2, 1)]


def test_a_table_that_differs_from_the_declaration_is_refused(conn):
    with db.transaction(conn) as cur:
        cur.execute("CREATE TABLE revenue (merchant text PRIMARY KEY, total bigint)")
    with pytest.raises(ConfigError, match=r"table revenue exists with columns merchant text, "
                                          r"total bigint, but the declaration needs merchant"):
        apply(conn, REVENUE, 1, [])


def test_staging_is_made_again_when_the_declaration_changes(conn):
    with db.transaction(conn) as cur:
        tables.ensure_staging(cur, "p", REVENUE.shape())
        wider = StateSpec("revenue", key={"merchant": "text", "day": "date"},
                          measures={"total": Sum("amount", "numeric(14,2)")})
        tables.ensure_staging(cur, "p", wider.shape())
        cur.execute("""SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute
                       WHERE attrelid = 'onceflow_staging."p.revenue"'::regclass AND attnum > 0
                         AND NOT attisdropped""")
        assert cur.fetchone()[0] == "txid,attempt,grp,merchant,day,total"



def test_the_staging_follows_a_widened_declaration_once(conn):
    """begin's step (follow_declaration): a staging made for Max numeric(5,2) is made again
    for numeric(8,2) (a value over 999.99 then stages), said once; nothing when it matches,
    and a staging that is missing is made."""
    def spec(largest: str) -> StateSpec:
        return StateSpec("totals", key={"merchant": "text"},
                         measures={"largest": Max("amount", largest), "orders": Count()})

    with db.transaction(conn) as cur:
        tables.ensure_staging(cur, "p", spec("numeric(5,2)").shape())
        assert tables.follow_declaration(cur, "p", [spec("numeric(5,2)").shape()]) == []
        assert tables.follow_declaration(cur, "p", [spec("numeric(8,2)").shape()]) == [
            "totals: largest numeric(5,2) -> numeric(8,2)"]
        assert tables.follow_declaration(cur, "p", [spec("numeric(8,2)").shape()]) == []
        cur.execute("""INSERT INTO onceflow_staging."p.totals"
                       (txid, attempt, grp, merchant, largest, orders)
                       VALUES (1, 1, 0, 'b', 1780.25, 1)""")
        assert tables.follow_declaration(cur, "q", [spec("numeric(8,2)").shape()]) == [
            "totals: made"]


def test_begin_refuses_a_table_narrower_than_its_widened_declaration(conn):
    """The declaration widened, the table not: refused naming the ALTER TABLE (the commit
    would fail on the value); once altered, accepted."""
    narrow = StateSpec("totals", key={"merchant": "text"},
                       measures={"largest": Max("amount", "numeric(5,2)")})
    wide = StateSpec("totals", key={"merchant": "text"},
                     measures={"largest": Max("amount", "numeric(8,2)")})
    with db.transaction(conn) as cur:
        tables.ensure_table(cur, narrow.shape(), narrow.opaque, with_txid_index=False)
        tables.check_types(cur, [(narrow.shape(), narrow.opaque)])
    with pytest.raises(ConfigError, match=re.escape(
            "table totals exists with column types other than the declaration's (largest "
            "numeric(5,2), declared numeric(8,2), prev_largest numeric(5,2), declared "
            "numeric(8,2)): alter it to the declared types (ALTER TABLE totals ALTER COLUMN "
            "largest TYPE numeric(8,2), ALTER COLUMN prev_largest TYPE numeric(8,2);")):
        with db.transaction(conn) as cur:
            tables.check_types(cur, [(wide.shape(), wide.opaque)])
    with db.transaction(conn) as cur:
        cur.execute("ALTER TABLE totals ALTER COLUMN largest TYPE numeric(8,2), "
                    "ALTER COLUMN prev_largest TYPE numeric(8,2)")
        tables.check_types(cur, [(wide.shape(), wide.opaque)])

def test_an_external_batch_round_trips_through_csv(conn, second_dsn):
    """copy_out / apply_csv: what the commit uses for a state in another database; numeric,
    dates and NULL-free keys survive the CSV exactly."""
    rows = as_rows(aggregate([("x,\"y\"", date(2026, 2, 28), Decimal("0.01")),
                              ("x,\"y\"", date(2026, 2, 28), Decimal("123456789.99"))]))
    with db.transaction(conn) as cur:
        source = batch(cur, REVENUE.shape(), rows)
        buf = io.StringIO()
        cur.copy_expert(cur.mogrify(sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(
            source)).decode(), buf)
    buf.seek(0)
    with db.connection(second_dsn) as other, db.transaction(other) as cur:
        tables.ensure_table(cur, REVENUE.shape(), True, with_txid_index=True)
        assert tables.apply_csv(cur, REVENUE.shape(), True, 1, buf) == 1
        cur.execute("SELECT merchant, total, orders, largest FROM revenue")
        assert cur.fetchall() == [("x,\"y\"", Decimal("123456790.00"), 2,
                                   Decimal("123456789.99"))]


@pytest.mark.parametrize("spec, message", [
    (dict(key={"k": "double precision"}, measures={"n": Count()}), "a double is no key"),
    (dict(key={"k": "varchar"}, measures={"n": Count()}), "use one of text, bigint"),
    (dict(measures={"n": Count()}), "give the key columns"),
    (dict(key={"k": "text"}), "give at least one measure"),
    (dict(key={"k": "text"}, measures={"n": Sum("v", "text")}), "a sum is bigint"),
    (dict(key={"k": "text"}, measures={"n": Count()}, order_by="v"), "order_by orders Last"),
    (dict(key={"k": "text"}, measures={"prev_n": Count()}), "not txid, prev_txid, prev_"),
    (dict(key={"k": "text"}, measures={"n": Max("v", "numeric(40,2)")}), "p up to 38"),
    (dict(kind="append", key={"k": "text"}, columns={"v": "text"}), "columns only"),
])
def test_bad_declarations_name_the_field_and_the_fix(spec, message):
    with pytest.raises(ConfigError, match=message) as caught:
        StateSpec("s", **spec).validate()
    assert "state[s]" in str(caught.value)


def test_a_staging_name_over_63_bytes_is_refused():
    with pytest.raises(ConfigError, match="must fit in 63 bytes"):
        Pipeline(name="p" * 40, source=PostgresLog(topic="t"), topology="x:y",
                 states=(StateSpec("s" * 30, key={"k": "text"},
                                   measures={"v": Last("v", "text")}),)).validate()


SMALL = StateSpec("small", key={"merchant": "text", "day": "date"},
                  measures={"total": Sum("amount", "numeric(6,2)"), "orders": Count()})
COUNTS = StateSpec("counts", kind="transactional", key={"k": "bigint"},
                   measures={"n": Sum("v", "smallint")})


def test_a_sum_keeps_its_declared_type_and_a_total_past_it_is_refused_naming_the_fix(conn):
    """The table's column is the numeric(6,2) declared (staging keeps a batch's sum wide);
    a running total past 9999.99 refuses the whole batch, naming the state, the key, the
    column, the type and the fix, and writes nothing."""
    day = date(2026, 1, 1)
    apply(conn, SMALL, 1, [("a", day, Decimal("7000.00"), 2), ("b", day, Decimal("10.00"), 1)])
    assert rows_of(conn, """SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
                            WHERE attrelid = 'small'::regclass AND attname LIKE '%total'
                            ORDER BY 1""") == [("prev_total", "numeric(6,2)"),
                                               ("total", "numeric(6,2)")]
    assert dict(SMALL.shape().staged())["total"] == "numeric(38,2)"
    with pytest.raises(StateOverflow) as refused:
        apply(conn, SMALL, 2, [("a", day, Decimal("3500.00"), 1), ("b", day, Decimal("5.00"), 1),
                               ("c", day, Decimal("12000.00"), 1)])
    assert str(refused.value) == (
        "state small: measures['total'] = Sum('amount', 'numeric(6,2)') for key "
        "(merchant='c', day=2026-01-01) would be 12000.00 (the table holds 0, txid 2 adds "
        "12000.00) (and 1 more key(s)): over numeric(6,2), the type its declaration gives "
        "column total. No record is at fault and none is dropped: the txid cannot commit while "
        "the column is this narrow. Declare a wider type (e.g. numeric(9,2)), alter the table "
        "to it (ALTER TABLE small ALTER COLUMN total TYPE numeric(9,2), ALTER COLUMN "
        "prev_total TYPE numeric(9,2)), then run the txid again")
    assert rows_of(conn, "SELECT merchant, total, orders, txid FROM small ORDER BY 1") == [
        ("a", Decimal("7000.00"), 2, 1), ("b", Decimal("10.00"), 1, 1)]
    # the fix the message gives, then the same batch commits
    with db.transaction(conn) as cur:
        cur.execute("ALTER TABLE small ALTER COLUMN total TYPE numeric(9,2), "
                    "ALTER COLUMN prev_total TYPE numeric(9,2)")
    wider = StateSpec("small", key={"merchant": "text", "day": "date"},
                      measures={"total": Sum("amount", "numeric(9,2)"), "orders": Count()})
    apply(conn, wider, 2, [("a", day, Decimal("3500.00"), 1), ("b", day, Decimal("5.00"), 1),
                           ("c", day, Decimal("12000.00"), 1)])
    assert rows_of(conn, "SELECT merchant, total, orders FROM small ORDER BY 1") == [
        ("a", Decimal("10500.00"), 3), ("b", Decimal("15.00"), 2), ("c", Decimal("12000.00"), 1)]


def test_an_integer_sum_past_its_type_is_refused_too(conn):
    apply(conn, COUNTS, 1, [(7, 30000)])
    with pytest.raises(StateOverflow, match=r"state counts: measures\['n'\] = Sum\('v', "
                                            r"'smallint'\) for key \(k=7\) would be 32800 \(the "
                                            r"table holds 30000, txid 2 adds 2800\): over "
                                            r"smallint.*e.g. integer\), alter the table to it "
                                            r"\(ALTER TABLE counts ALTER COLUMN n TYPE integer\)"):
        apply(conn, COUNTS, 2, [(7, 2800)])
    assert apply(conn, COUNTS, 2, [(7, 2000)]) == 1
    assert rows_of(conn, "SELECT k, n, txid FROM counts") == [(7, 32000, 2)]


def test_a_table_of_the_same_columns_and_other_types_is_given_its_alter_table(conn):
    """A typed state made when sums were widened to numeric(38,s): refused with the
    statement that migrates it, then accepted."""
    with db.transaction(conn) as cur:
        cur.execute("""CREATE TABLE small (merchant text NOT NULL, day date NOT NULL,
                       txid bigint NOT NULL, prev_txid bigint, total numeric(38,2),
                       prev_total numeric(38,2), orders bigint, prev_orders bigint,
                       PRIMARY KEY (merchant, day))""")
    alter = ("ALTER TABLE small ALTER COLUMN total TYPE numeric(6,2), ALTER COLUMN prev_total "
             "TYPE numeric(6,2)")
    with pytest.raises(ConfigError) as refused:
        apply(conn, SMALL, 1, [])
    assert str(refused.value) == (
        "state[small]: table small exists with column types other than the declaration's "
        "(total numeric(38,2), declared numeric(6,2), prev_total numeric(38,2), declared "
        f"numeric(6,2)): alter it to the declared types ({alter}; a value that does not fit a "
        "new type makes it fail), or declare the types it has")
    with db.transaction(conn) as cur:
        cur.execute(alter)
    assert apply(conn, SMALL, 1, [("a", date(2026, 1, 1), Decimal("1.50"), 1)]) == 1
