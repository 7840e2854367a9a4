"""The orders example's data: the orders table, a generator, concurrent writers that commit
out of order on purpose, Parquet files landed the safe way, and the expected result computed
without onceflow (plain SQL over the orders table, or plain Python over the rows)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg2

LARGE = Decimal("1000.00")
ERR_MALFORMED = "malformed order"
ERR_REFUND = "amount is not positive (a refund is no order)"
ORDERS_DDL = """
CREATE TABLE IF NOT EXISTS public.orders (
    order_id   bigint GENERATED ALWAYS AS IDENTITY (CACHE 1) PRIMARY KEY,
    merchant   text          NOT NULL,
    amount     numeric(12,2) NOT NULL,
    ordered_at timestamptz   NOT NULL
)"""
_START = datetime(2026, 11, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Order:
    merchant: str
    amount: Decimal
    ordered_at: datetime
    order_id: int | None = None


def generate(count: int, *, seed: int = 7, refund_share: float = 0.02,
             start_id: int | None = None) -> Iterator[Order]:
    """``count`` orders from 40 merchants over two weeks; amounts skewed, a few of them
    1000.00 or more, ``refund_share`` of them refunds (zero or negative amounts).
    ``start_id``: number them from it (the files variant; the table numbers its own)."""
    rng = random.Random(seed)
    for i in range(count):
        merchant = f"merchant-{min(int(rng.paretovariate(1.1)), 40):02d}"
        cents = int(rng.lognormvariate(8.5, 1.2))
        if rng.random() < refund_share:
            cents = -rng.randrange(0, 5000)
        at = _START + timedelta(microseconds=rng.randrange(14 * 86_400 * 10**6))
        yield Order(merchant, Decimal(cents) / 100, at,
                    None if start_id is None else start_id + i)


def create_table(conn) -> None:
    with conn.cursor() as cur:
        cur.execute(ORDERS_DDL)
    conn.commit()


@dataclass
class Writers:
    """``writers`` threads inserting ``orders`` in small transactions that stay open a random
    while, so that a transaction holding a smaller order_id often commits after one holding a
    larger (out-of-order commits, what the table source must never lose a row to)."""

    dsn: str
    orders: list[Order]
    writers: int = 4
    max_hold_s: float = 0.05
    seed: int = 11
    errors: list[BaseException] = field(default_factory=list)
    written: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._write, args=(i,), daemon=True)
                         for i in range(self.writers)]

    def _write(self, index: int) -> None:
        rng = random.Random(self.seed + index)
        mine = self.orders[index::self.writers]
        try:
            conn = psycopg2.connect(self.dsn, application_name=f"orders-writer-{index}")
            with conn:
                i = 0
                while i < len(mine):
                    chunk = mine[i:i + rng.randint(1, 25)]
                    with conn.cursor() as cur:
                        cur.executemany(
                            "INSERT INTO public.orders (merchant, amount, ordered_at) "
                            "VALUES (%s, %s, %s)",
                            [(o.merchant, o.amount, o.ordered_at) for o in chunk])
                        time.sleep(rng.random() * self.max_hold_s)  # hold the ids a while
                    conn.commit()
                    i += len(chunk)
                    with self._lock:
                        self.written += len(chunk)
            conn.close()
        except BaseException as error:  # reported by join()
            self.errors.append(error)

    def start(self) -> Writers:
        for thread in self._threads:
            thread.start()
        return self

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        if self.errors:
            raise RuntimeError(f"an orders writer failed: {self.errors[0]!r}")


def land_parquet(folder: Path, orders: list[Order], name: str) -> Path:
    """One Parquet file landed the safe way: written under a temporary name (``.tmp``, which
    the landing folder skips), then renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "order_id": pa.array([o.order_id for o in orders], pa.int64()),
        "merchant": pa.array([o.merchant for o in orders], pa.string()),
        "amount": pa.array([o.amount for o in orders], pa.decimal128(12, 2)),
        "ordered_at": pa.array([o.ordered_at for o in orders], pa.timestamp("us", tz="UTC")),
    })
    final = folder / name
    temporary = folder / f"{name}.tmp"
    pq.write_table(table, temporary)
    temporary.rename(final)
    return final


# -- the expected result, without onceflow ------------------------------------------------------
@dataclass
class Expected:
    revenue: dict = field(default_factory=dict)  # (merchant, day) -> (revenue, orders, largest)
    large: Counter = field(default_factory=Counter)  # (order_id, merchant, amount, ordered_at)
    last_order: dict = field(default_factory=dict)  # merchant -> (order_id, ordered_at)
    refunds: int = 0
    orders: int = 0


def expected_from_rows(orders: list[Order]) -> Expected:
    out = Expected()
    for o in orders:
        out.orders += 1
        if o.amount <= 0:
            out.refunds += 1
            continue
        key = (o.merchant, o.ordered_at.astimezone(UTC).date())
        revenue, n, largest = out.revenue.get(key, (Decimal(0), 0, o.amount))
        out.revenue[key] = (revenue + o.amount, n + 1, max(largest, o.amount))
        if o.amount >= LARGE:
            out.large[(o.order_id, o.merchant, o.amount, o.ordered_at)] += 1
        if o.merchant not in out.last_order or out.last_order[o.merchant][0] < o.order_id:
            out.last_order[o.merchant] = (o.order_id, o.ordered_at)
    return out


def expected_from_table(conn) -> Expected:
    """The same from the orders table, in plain SQL."""
    with conn.cursor() as cur:
        cur.execute("SELECT order_id, merchant, amount, ordered_at FROM public.orders")
        rows = [Order(m, a, t, i) for i, m, a, t in cur.fetchall()]
    conn.commit()
    return expected_from_rows(rows)


def committed(conn, prefix: str = "", coordinator=None) -> Expected:
    """What the pipeline committed, in the same form (``coordinator``: the coordinator's
    connection when the tables live in another database)."""
    out = Expected()
    with conn.cursor() as cur:
        cur.execute(f"SELECT merchant, day, revenue, orders, largest "  # noqa: S608
                    f"FROM {prefix}merchant_day_revenue")
        out.revenue = {(m, d): (r, n, x) for m, d, r, n, x in cur.fetchall()}
        cur.execute(f"SELECT order_id, merchant, amount, ordered_at "  # noqa: S608
                    f"FROM {prefix}large_orders")
        out.large = Counter(cur.fetchall())
        cur.execute(f"SELECT merchant, order_id, ordered_at "  # noqa: S608
                    f"FROM {prefix}merchant_last_order")
        out.last_order = {m: (i, t) for m, i, t in cur.fetchall()}
    conn.commit()
    coordinator = coordinator or conn
    with coordinator.cursor() as cur:
        cur.execute("SELECT count(*) FROM rejected_records WHERE pipeline = %s",
                    (f"orders{'_files' if prefix else ''}",))
        out.refunds = cur.fetchone()[0]
    coordinator.commit()
    return out


def differences(want: Expected, got: Expected) -> list[str]:
    out = []
    for name in ("revenue", "large", "last_order"):
        a, b = getattr(want, name), getattr(got, name)
        if a != b:
            missing = [k for k in a if a.get(k) != b.get(k)][:3]
            extra = [k for k in b if k not in a][:3]
            out.append(f"{name}: {len(a)} expected, {len(b)} committed; differing e.g. "
                       f"{missing}, unexpected e.g. {extra}")
    if want.refunds != got.refunds:
        out.append(f"refunds: {want.refunds} expected as rejected records, {got.refunds} kept")
    return out




# -- the recount for `onceflow verify --recount` -------------------------------------------------
@dataclass
class Recount:
    records: int = 0
    rejected: Counter = field(default_factory=Counter)
    failing: Counter = field(default_factory=Counter)
    counts: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)  # sink -> rows (dicts of the state's columns)


def parse_order(payload: str) -> Order | None:
    """An order from a payload (row_to_json from the table, or a Parquet row as JSON), or
    None when it is malformed; the Python twin of the topology's parse."""
    import json

    try:
        doc = json.loads(payload, parse_float=Decimal)
        order = Order(doc["merchant"], Decimal(str(doc["amount"])),
                      datetime.fromisoformat(str(doc["ordered_at"])).astimezone(UTC),
                      int(doc["order_id"]))
    except (ValueError, KeyError, TypeError, ArithmeticError):
        return None
    if order.merchant is None:
        return None
    return order


def recount(payloads, pipeline=None) -> Recount:
    out = Recount()
    orders = []
    for payload in payloads:
        out.records += 1
        order = parse_order(payload)
        if order is None:
            out.rejected[ERR_MALFORMED] += 1
        elif order.amount <= 0:
            out.rejected[ERR_REFUND] += 1
        else:
            orders.append(order)
    want = expected_from_rows(orders)
    out.tables = {
        "revenue": [{"merchant": m, "day": d, "revenue": r, "orders": n, "largest": x}
                    for (m, d), (r, n, x) in want.revenue.items()],
        "large": [{"order_id": i, "merchant": m, "amount": a, "ordered_at": t}
                  for (i, m, a, t), n in want.large.items() for _ in range(n)],
        "last_order": [{"merchant": m, "order_id": i, "ordered_at": t}
                       for m, (i, t) in want.last_order.items()],
    }
    return out
