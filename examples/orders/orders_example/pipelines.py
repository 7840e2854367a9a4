"""The orders example's pipelines (entry point ``orders`` in the group ``onceflow.pipelines``).

Both compute, from orders, exactly once:

- ``merchant_day_revenue``: per (merchant, UTC day) the revenue (numeric sum, exact to the
  cent), the number of orders and the largest order;
- ``large_orders``: an append table of the orders of 1000.00 or more, with the txid that
  committed them;
- ``merchant_last_order``: an upsert table, each merchant's order with the highest id.

A refund (an amount of zero or less) is not an order: it is kept as a rejected record.
"""

from __future__ import annotations

import os
from pathlib import Path

from onceflow import Count, LandingFolder, Max, Pipeline, StateSpec, Sum, TableSource

MONEY = "numeric(12,2)"


def _states(prefix: str = "") -> tuple[StateSpec, ...]:
    return (
        StateSpec(f"{prefix}merchant_day_revenue", source="revenue",
                  key={"merchant": "text", "day": "date"},
                  measures={"revenue": Sum("amount", MONEY), "orders": Count(),
                            "largest": Max("amount", MONEY)}),
        StateSpec.append(f"{prefix}large_orders", source="large",
                         columns={"order_id": "bigint", "merchant": "text", "amount": MONEY,
                                  "ordered_at": "timestamptz"}),
        StateSpec.upsert(f"{prefix}merchant_last_order", source="last_order",
                         key={"merchant": "text"},
                         columns={"order_id": "bigint", "ordered_at": "timestamptz"},
                         order_by="order_id"),
    )


def landing_path() -> str:
    """Where the files variant's Parquet files land: ORDERS_LANDING, else
    $ONCEFLOW_HOME/.run/landing/orders (the current directory without ONCEFLOW_HOME)."""
    if os.environ.get("ORDERS_LANDING"):
        return os.environ["ORDERS_LANDING"]
    home = Path(os.environ.get("ONCEFLOW_HOME") or Path.cwd())
    return str(home / ".run" / "landing" / "orders")


ORDERS = Pipeline(
    name="orders",
    description="Revenue per merchant and day, large orders and last orders, from the "
                "orders table.",
    source=TableSource(topic="orders", table="public.orders", key="order_id",
                       time_column="ordered_at"),
    topology="orders_example.topology:topology",
    recompute="orders_example.data:recount",
    states=_states(),
    batch_size=50_000,
)

ORDERS_FILES = Pipeline(
    name="orders_files",
    description="The same from Parquet files dropped into a landing folder.",
    source=LandingFolder(topic="orders_files", path=landing_path(), format="parquet",
                         pattern="*.parquet",
                         schema="order_id long, merchant string, amount decimal(12,2), "
                                "ordered_at timestamp"),
    topology="orders_example.topology:topology",
    recompute="orders_example.data:recount",
    states=_states("files_"),
    batch_size=50_000,
)

PIPELINES = (ORDERS, ORDERS_FILES)
