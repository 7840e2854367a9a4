-- Issue 14: the landing-folder source. Its manifest: each landed file once, in arrival order,
-- with what proves it unchanged (size, modification time, SHA-256) and where its records start
-- in its partition's offsets; and where each piece of a file starts (the Spark read tasks).
-- Heads stay in source_partitions, as for the other logs.
CREATE TABLE IF NOT EXISTS landing_files (
    topic       text             NOT NULL,
    file_no     bigint           NOT NULL,
    partition   integer          NOT NULL,
    path        text             NOT NULL,
    size        bigint           NOT NULL,
    mtime       double precision NOT NULL,
    checksum    text             NOT NULL,
    records     bigint           NOT NULL CHECK (records >= 0),
    base_offset bigint           NOT NULL,
    refused     text,            -- why the file was set aside (a schema mismatch), if it was
    indexed_at  timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, file_no),
    UNIQUE (topic, path)
);

CREATE TABLE IF NOT EXISTS landing_chunks (
    topic        text    NOT NULL,
    file_no      bigint  NOT NULL,
    first_offset bigint  NOT NULL,
    byte_start   bigint  NOT NULL,
    byte_end     bigint  NOT NULL,
    records      integer NOT NULL,
    PRIMARY KEY (topic, file_no, first_offset),
    FOREIGN KEY (topic, file_no) REFERENCES landing_files (topic, file_no)
);
CREATE INDEX IF NOT EXISTS landing_chunks_offsets ON landing_chunks (topic, first_offset);
