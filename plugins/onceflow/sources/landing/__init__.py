"""A landing folder: files dropped into a directory are the source, in arrival order.

JSON-lines files (a record per line, the payload is the line), CSV files (a record per RFC
4180 record: a quoted field may hold newlines; an empty line is no record; the payload is
the record's text) and Parquet files (a record per row, the payload is the row as JSON) in
a folder: a local path, or any URI pyarrow's file systems read (``s3://``, ``hdfs://``,
``file://``). docs/landing-folder.md is the producer's side of it (how to land a file,
appends, rewrites, repair).

**The manifest.** Each begin looks at the folder first: a new file is indexed in arrival order
(modification time, then name) into ``landing_files`` (path, size, modification time, how far
it is indexed, record count) and ``landing_chunks`` (the file cut at newlines about every
``chunk_bytes``: where each piece starts, in records and in bytes, and the CRC-32 of its
bytes), and its records get the next offsets of its partition (files go to partitions in
turn), in the same PostgreSQL transaction that advances the heads (``source_partitions``, as
for the other logs). So every offset below a head is a record of an indexed chunk, and a batch
is a range over the manifest.

**Rules, loudly kept.**

- A line is indexed once it is complete (its newline written): the bytes after a file's last
  newline wait for the next look (``unterminated_s`` indexes a last line without one, once
  its file has stayed unmodified that long).
- A file that grew, its indexed bytes unchanged (its last indexed chunk's CRC-32 and its
  size say so), is a source of more records: its new complete lines are indexed as new
  chunks, their records at the next offsets of the file's partition. A touched file (another
  modification time only) is the same file.
- Names starting with ``.`` or ``_``, or ending in ``.tmp``, ``.part`` or ``._COPYING_``, are
  skipped, and so is a file modified less than ``settle_s`` seconds ago. Write a file under
  a temporary name and rename it into place.
- Every read checks each chunk's bytes against the CRC-32 indexed (Parquet: the footer's and
  the row group's): a chunk whose bytes changed fails its batch naming the file and the
  chunk. A file found shorter than indexed, or whose last indexed chunk changed, is marked
  changed (``landing_files.changed``, shown by ``onceflow status``) and not indexed further;
  ``onceflow repair`` says what changed and accepts the file as it is now or skips it with
  a recorded gap (onceflow.sources.landing_repair).
- A file removed before every batch that reads it committed fails that batch's read
  (SourceChanged, naming it: retries would not find it either); ``onceflow repair`` skips
  its unread records with a recorded gap.
- JSON lines with a declared ``json_schema``: each line is decoded where it is read
  (onceflow.sources.json_records): the records carry the declared columns and
  ``_corrupt_record`` instead of ``payload``.
- Parquet: a file whose schema is not the declared ``schema`` (a column missing, or of a
  type Spark's Parquet reader cannot read as declared: see _reads_as) is set aside
  (``on_mismatch="skip"``: recorded with its reason, indexed with no records, shown by
  status) or stops the pipeline (``on_mismatch="stop"``: begin fails naming the file).
  With ``typed`` the records carry the declared columns (and ``_corrupt_record``, always
  null) instead of ``payload``: Spark's Parquet reader then decodes only the columns the
  topology uses, and no row is turned into JSON and parsed back. A replayed record comes
  back from its payload (the row as JSON) through the same JsonRecords decoder as JSON
  lines, so it sees the columns its first try saw. A typed row is refused only when a
  float column holds NaN or an infinity (which its JSON payload cannot hold).
"""

from onceflow.sources.landing.folder import FORMATS, LandingFolder

__all__ = ["FORMATS", "LandingFolder"]
