"""Typed tables: state with composite typed keys and several measures, upsert tables (latest
row per key) and append tables (facts with a txid column). Their columns and types, their
DDL, their staging tables and the set-based SQL that applies a batch in the ordered commit.

A typed state (``StateSpec(key=..., measures=...)``) holds per key one value per measure and,
when opaque, each measure's value before the last txid that wrote it (``prev_<measure>``)
and that txid's predecessor (``prev_txid``): a replay of the txid starts again from the
previous values, so it never counts twice (onceflow.core.opaque is the rule in Python). An
upsert table is a typed state whose measures are all ``Last``. An append table
(``kind="append"``) holds the batch's rows with their txid; applying a txid replaces its own
rows, so a replay leaves exactly one copy.

Staging: one UNLOGGED table per pipeline and typed state, ``onceflow_staging."<pipeline>.<state>"``,
with the processing groups' rows already aggregated by Spark, written by COPY; the commit
aggregates across groups only when the batch has several.

The modules: types (the column types and their Spark types), shape (the measures, the
declaration's checks, the Shape), ddl (the staging and state tables made and checked), apply
(a batch applied in the ordered commit, the table read back).
"""

from onceflow.core.tables.apply import (
    apply_batch,
    apply_csv,
    copy_out,
    read_table,
    staged_batch,
)
from onceflow.core.tables.ddl import (
    check_types,
    ensure_staging,
    ensure_table,
    expected_columns,
    follow_declaration,
)
from onceflow.core.tables.shape import (
    AGGREGATES,
    ORDER,
    STAGING_SCHEMA,
    Count,
    Last,
    Max,
    Measure,
    Min,
    Shape,
    Sum,
    staging_name_ok,
    staging_table,
    validate_shape,
)
from onceflow.core.tables.types import (
    SPARK_JSON,
    TYPE_HELP,
    conversion_loss,
    known_type,
    normal_type,
    spark_type,
)

__all__ = [
    "AGGREGATES", "ORDER", "SPARK_JSON", "STAGING_SCHEMA", "TYPE_HELP", "Count", "Last", "Max",
    "Measure", "Min", "Shape", "Sum", "apply_batch", "apply_csv", "check_types",
    "conversion_loss", "copy_out", "ensure_staging", "ensure_table", "expected_columns",
    "follow_declaration", "known_type", "normal_type", "read_table", "spark_type",
    "staged_batch", "staging_name_ok", "staging_table", "validate_shape",
]
