-- Issue 37: a landed chunk's bytes are checked against what was indexed whenever they are read;
-- a landed file may grow (its new complete lines are indexed as new chunks); a file that
-- changed otherwise is marked, and `onceflow repair` accepts or skips it.

-- CRC-32 (zlib's, java.util.zip.CRC32's) of the chunk's bytes [byte_start, byte_end); of a
-- Parquet row group's bytes. NULL: indexed before this column (its file's size and
-- modification time are checked instead).
ALTER TABLE landing_chunks ADD COLUMN IF NOT EXISTS crc bigint;
-- Why these offsets hold no record any more (onceflow repair: the bytes changed before they
-- were read, and were re-indexed at other offsets or skipped); NULL: they hold their records.
ALTER TABLE landing_chunks ADD COLUMN IF NOT EXISTS void text;

-- How far the file is indexed, in bytes: the end of its last complete line (a line without
-- its newline yet is not indexed); the next look indexes from there when the file grew.
-- size and mtime are the file's as last looked at.
ALTER TABLE landing_files ADD COLUMN IF NOT EXISTS indexed_to bigint;
UPDATE landing_files SET indexed_to = size WHERE indexed_to IS NULL;
ALTER TABLE landing_files ALTER COLUMN indexed_to SET NOT NULL;
-- What changed in the indexed bytes (shrunk, bytes differ) when a look found it; NULL: none.
ALTER TABLE landing_files ADD COLUMN IF NOT EXISTS changed text;
-- onceflow repair --skip-changed: the file is not followed any more (why, and when).
ALTER TABLE landing_files ADD COLUMN IF NOT EXISTS skipped text;
-- The file-level fingerprint is no longer the check (the chunks' CRC-32s are); Parquet files
-- keep the CRC-32 of their footer here (the metadata that says where the row groups lie).
ALTER TABLE landing_files ALTER COLUMN checksum DROP NOT NULL;
-- Every begin asks for the changed files of its topic (Source.held_back): few or none.
CREATE INDEX IF NOT EXISTS landing_files_changed ON landing_files (topic)
    WHERE changed IS NOT NULL AND skipped IS NULL;
