"""Declarations over orders' amounts (tests/test_declarations.py): two that run, and two
that `onceflow pipelines`, `onceflow init` and the DAG's build refuse before any data."""

from onceflow import Count, Max, Pipeline, PostgresLog, StateSpec, Sum


def _pipeline(name: str, measures: dict, topology: str = "amounts.topology:build"
              ) -> Pipeline:
    return Pipeline(name=name, source=PostgresLog(topic=name, partitions=2), topology=topology,
                    states=(StateSpec(f"{name}_totals", source="totals",
                                      key={"merchant": "text"}, measures=measures),),
                    batch_size=1000, max_replays=0, retries=0)


# The largest order in a numeric(5,2) while amounts reach thousands: those records fail alone.
AMOUNTS = _pipeline("amounts", {"revenue": Sum("amount", "numeric(12,2)"),
                                "largest": Max("amount", "numeric(5,2)"), "orders": Count()})
# A sum kept in the numeric(6,2) it declares: a running total past 9999.99 is refused.
SMALL_SUM = _pipeline("small_sum", {"revenue": Sum("amount", "numeric(6,2)"),
                                    "orders": Count()})
# "amont": no stream has it
MISSING_COLUMN = _pipeline("missing_column", {"largest": Max("amont", "numeric(12,2)")})
# "amount" is decimal(12,2) in one stream and double in another
TYPE_CONFLICT = _pipeline("type_conflict", {"revenue": Sum("amount", "numeric(12,2)")},
                          topology="amounts.topology:with_fees")

GOOD = (AMOUNTS, SMALL_SUM)
ALL = (AMOUNTS, SMALL_SUM, MISSING_COLUMN, TYPE_CONFLICT)
