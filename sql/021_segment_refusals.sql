-- Issue 39: what a file segment's writer learnt of its payloads when it wrote the segment:
-- none holds a NUL character, and the longest is largest_bytes bytes (UTF-8). NULL: not so,
-- or not known (a segment written before this column). A batch whose segments all have
-- largest_bytes within the source's max_record_bytes holds no record the spout could
-- refuse, so the batch is not searched for one.
ALTER TABLE source_segments ADD COLUMN IF NOT EXISTS largest_bytes integer;
