-- onceflow core schema: the source log, the coordinator, the offset log (batch ranges), the
-- commit log (transactions), staging and partition offsets. Idempotent: every statement can
-- run again. State tables are created per pipeline by `onceflow init` (onceflow/state.py).

-- The source: a partitioned, offset-addressed, replayable log (the "eden" queue).
CREATE TABLE IF NOT EXISTS source_partitions (
    topic            text    NOT NULL,
    partition        integer NOT NULL CHECK (partition >= 0),
    -- the next offset the producer hands out; every offset below it is written and visible.
    next_offset      bigint  NOT NULL DEFAULT 0 CHECK (next_offset >= 0),
    -- retention: records below this offset may have been deleted.
    log_start_offset bigint  NOT NULL DEFAULT 0 CHECK (log_start_offset >= 0),
    PRIMARY KEY (topic, partition)
);

CREATE TABLE IF NOT EXISTS source_log (
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    "offset"    bigint      NOT NULL,
    payload     text        NOT NULL,
    produced_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, "offset")
);

-- The coordinator row of a pipeline: locked by begin and by commit.
CREATE TABLE IF NOT EXISTS pipelines (
    name                text        PRIMARY KEY,
    instance_id         uuid        NOT NULL,
    topic               text        NOT NULL,
    mode                text        NOT NULL DEFAULT 'transactional'
                                    CHECK (mode IN ('transactional', 'opaque')),
    next_txid           bigint      NOT NULL DEFAULT 1,
    last_committed_txid bigint      NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now()
);

-- One row per transaction: its current attempt and its state (the commit log is
-- state = 'committed', written last by the commit).
CREATE TABLE IF NOT EXISTS transactions (
    pipeline            text        NOT NULL REFERENCES pipelines (name),
    txid                bigint      NOT NULL CHECK (txid > 0),
    attempt             integer     NOT NULL DEFAULT 1 CHECK (attempt > 0),
    state               text        NOT NULL DEFAULT 'planned'
                                    CHECK (state IN ('planned', 'committed', 'failed', 'superseded')),
    run_id              text,
    groups              integer     NOT NULL DEFAULT 1 CHECK (groups > 0),
    records             bigint      NOT NULL DEFAULT 0,
    planned_at          timestamptz NOT NULL DEFAULT now(),
    commit_requested_at timestamptz,
    committed_at        timestamptz,
    commit_wait_s       double precision,
    rows_applied        bigint,
    PRIMARY KEY (pipeline, txid)
);

-- Which Airflow run attempts which txid (a retry or a Clear of the run reuses it).
CREATE TABLE IF NOT EXISTS transaction_runs (
    pipeline text   NOT NULL,
    run_id   text   NOT NULL,
    txid     bigint NOT NULL,
    PRIMARY KEY (pipeline, run_id),
    FOREIGN KEY (pipeline, txid) REFERENCES transactions (pipeline, txid)
);

-- The offset log: what txid N reads, written by begin BEFORE any processing.
CREATE TABLE IF NOT EXISTS batch_ranges (
    pipeline     text    NOT NULL,
    txid         bigint  NOT NULL,
    topic        text    NOT NULL,
    partition    integer NOT NULL,
    grp          integer NOT NULL DEFAULT 0,
    start_offset bigint  NOT NULL,
    end_offset   bigint  NOT NULL,
    CHECK (end_offset >= start_offset),
    PRIMARY KEY (pipeline, txid, partition),
    FOREIGN KEY (pipeline, txid) REFERENCES transactions (pipeline, txid)
);

-- Committed offsets (the PartitionManager's record): every record below "offset" is done.
-- Written only by the commit transaction.
CREATE TABLE IF NOT EXISTS partition_offsets (
    pipeline      text        NOT NULL,
    instance_id   uuid        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    "offset"      bigint      NOT NULL CHECK ("offset" >= 0),
    txid          bigint      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, partition)
);

-- Staging written by the processing phase, keyed by (txid, attempt, group). A re-run of the
-- same (txid, attempt, group) replaces its rows; the commit reads only the current attempt.
CREATE UNLOGGED TABLE IF NOT EXISTS staged_deltas (
    pipeline   text    NOT NULL,
    txid       bigint  NOT NULL,
    attempt    integer NOT NULL,
    grp        integer NOT NULL,
    state_name text    NOT NULL,
    key        text    NOT NULL,
    delta      bigint  NOT NULL,
    PRIMARY KEY (pipeline, txid, attempt, grp, state_name, key)
);

CREATE UNLOGGED TABLE IF NOT EXISTS staged_rejects (
    pipeline  text    NOT NULL,
    txid      bigint  NOT NULL,
    attempt   integer NOT NULL,
    grp       integer NOT NULL,
    topic     text    NOT NULL,
    partition integer NOT NULL,
    "offset"  bigint  NOT NULL,
    error     text    NOT NULL,
    PRIMARY KEY (pipeline, txid, attempt, grp, partition, "offset")
);

-- A group's staging is complete only once its marker row exists (written last, same
-- PostgreSQL transaction as its deltas).
CREATE TABLE IF NOT EXISTS staged_groups (
    pipeline  text        NOT NULL,
    txid      bigint      NOT NULL,
    attempt   integer     NOT NULL,
    grp       integer     NOT NULL,
    records   bigint      NOT NULL,
    rejected  bigint      NOT NULL,
    delta_rows bigint     NOT NULL,
    staged_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, txid, attempt, grp)
);

-- Records the pipeline could not use (malformed payloads), kept with their position and error.
CREATE TABLE IF NOT EXISTS rejected_records (
    pipeline  text        NOT NULL,
    topic     text        NOT NULL,
    partition integer     NOT NULL,
    "offset"  bigint      NOT NULL,
    error     text        NOT NULL,
    txid      bigint      NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, topic, partition, "offset")
);

-- begin looks up the end of the last planned range per partition.
CREATE INDEX IF NOT EXISTS batch_ranges_partition_end
    ON batch_ranges (pipeline, partition, end_offset);
