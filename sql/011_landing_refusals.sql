-- What the indexer learnt of a landed chunk's lines on its one pass over the file: every line
-- is valid UTF-8, holds no NUL byte and is at most clean_to bytes long (the source's
-- max_record_bytes when the file was indexed). NULL: not so, or not known (a chunk indexed
-- before this column, a Parquet row group). A batch whose chunks all have clean_to within
-- today's max_record_bytes holds no record the spout could refuse, so it is not looked for.
ALTER TABLE landing_chunks ADD COLUMN IF NOT EXISTS clean_to bigint;
