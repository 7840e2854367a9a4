-- Issue 4: the file-segment source. Records live in Parquet segment files (one folder per
-- partition, files named by base offset); this table is their index. source_partitions stays
-- the catalog of heads for both kinds: a segment is written (and fsynced) before its row and
-- the new head commit, so every offset below a head is readable.
CREATE TABLE IF NOT EXISTS source_segments (
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    base_offset bigint  NOT NULL,
    records     integer NOT NULL CHECK (records > 0),
    path        text    NOT NULL,
    PRIMARY KEY (topic, partition, base_offset),
    FOREIGN KEY (topic, partition) REFERENCES source_partitions (topic, partition)
);
