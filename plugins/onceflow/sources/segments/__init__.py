"""File segments: a partitioned log of Parquet segment files, for bulk data.

Layout: ``ROOT/TOPIC/pPARTITION/BASEOFFSET.parquet`` (zero-padded names), each file holding
consecutive offsets of one partition (columns partition, offset, payload, produced_at). The
index is the ``source_segments`` table; heads are ``source_partitions`` (onceflow.sources.
catalog) as for the PostgreSQL log. A producer writes and fsyncs a segment first, then
records it and the new head in one PostgreSQL transaction: a crash in between leaves an
unindexed file, never an indexed hole. Spark's own Parquet reader reads exactly the indexed
segments that overlap the planned ranges, filtered to the ranges, in parallel in the JVM.
The index also keeps what the writer saw of each segment's payloads (``largest_bytes``: the
longest, when none holds a NUL), so a batch is searched for records the spout refuses only
when one of its segments may hold one.

A segment is written in row groups of ROW_GROUP_ROWS consecutive offsets, with min/max
statistics on partition and offset: the range filter is pushed down to
the Parquet reader, which decodes only the row groups that meet a range, so a batch smaller
than a segment does not decode the whole segment; ``payloads`` (Python) picks the row groups
by the same statistics. A segment of one row group (as written before) reads the same way.

With a declared ``json_schema`` each payload is decoded where it is read, by the rules of
onceflow.sources.json_records, as a landing folder's JSON lines are: the records carry the
declared columns and ``_corrupt_record`` instead of ``payload``, and the topology parses
nothing. In the JVM when the session has onceflow's jar (``onceflow.spark.SegmentsSource``:
the payload bytes of the row groups that meet the ranges go straight to the decoder), else
in Python workers (pyarrow and msgspec); the two give the same rows.

The root folder: the source's ``path``, else ``ONCEFLOW_SEGMENTS_DIR``, else
``$ONCEFLOW_HOME/.run/segments``. On a cluster it must be a folder every worker sees (a
shared mount, or any Hadoop file system URI Spark can read).

The modules: source (FileSegments), write (a segment file, a producer's append), bulk_import
(records imported at their own offsets), read (the segments and row groups a batch reads).
"""

import importlib

from onceflow.sources.segments.source import SPARK_SCHEMA, FileSegments, jvm_segments, segments_for

# The modules that import pyarrow at their top, and the names each gives: loaded when first
# asked for (PEP 562), so that `import onceflow` loads no pyarrow.
_ARROW_SIDE = {
    "write": ("ROW_GROUP_ROWS", "produce_segments", "segment_path", "write_segment"),
    "read": ("read_ranges", "row_groups"),
    "bulk_import": ("ON_CONFLICT", "Imported", "import_segments", "read_export"),
}


def __getattr__(name: str):
    for module, names in _ARROW_SIDE.items():
        if name == module or name in names:
            loaded = importlib.import_module(f"{__name__}.{module}")
            return loaded if name == module else getattr(loaded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ON_CONFLICT", "ROW_GROUP_ROWS", "SPARK_SCHEMA", "FileSegments", "Imported",
    "import_segments", "jvm_segments", "produce_segments", "read_export", "read_ranges",
    "row_groups", "segment_path", "segments_for", "write_segment",
]
