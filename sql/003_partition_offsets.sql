-- Issue 4: start policies, resets, offsets out of range and the gaps they leave.

-- A reset (force_from_start) forgets every range planned up to this txid.
ALTER TABLE pipelines ADD COLUMN IF NOT EXISTS reset_after_txid bigint NOT NULL DEFAULT 0;

-- Records a pipeline skipped because they were gone (retention) or by a policy: logged once.
CREATE TABLE IF NOT EXISTS offset_gaps (
    pipeline    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    from_offset bigint      NOT NULL,
    to_offset   bigint      NOT NULL,
    txid        bigint      NOT NULL,
    policy      text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    CHECK (to_offset >= from_offset),
    PRIMARY KEY (pipeline, partition, from_offset)
);

-- Start policy "timestamp" looks records up by time.
CREATE INDEX IF NOT EXISTS source_log_produced_at ON source_log (topic, partition, produced_at);

-- What retention deleted of records a pipeline had already committed, so that verify can
-- still account for them: per state and key, and the number of records and rejects.
CREATE TABLE IF NOT EXISTS retired_counts (
    pipeline   text   NOT NULL,
    state_name text   NOT NULL,
    key        text   NOT NULL,
    value      bigint NOT NULL,
    PRIMARY KEY (pipeline, state_name, key)
);

CREATE TABLE IF NOT EXISTS retired_records (
    pipeline text   PRIMARY KEY,
    records  bigint NOT NULL DEFAULT 0,
    rejected bigint NOT NULL DEFAULT 0
);
