-- Issue 39: verify a txid range without re-running the whole history, and where a begin's
-- time goes.

-- What each committed txid added to each count state (StateSpec without key/measures),
-- written by its commit from the staged deltas it applied: the keys it wrote, the sum of
-- its deltas and a digest, the sum over its keys of key_weight(key) * delta (key_weight:
-- hashtextextended(key, 0); onceflow.core.state_tables.KEY_WEIGHT). Both sums are linear, so a
-- state table's sum(value) and sum(key_weight(key) * value) equal the sums over every
-- txid's row: `onceflow verify --txids A..B` re-runs only A..B and compares their rows,
-- and checks the tables against all rows without reading any record.
CREATE TABLE IF NOT EXISTS batch_contributions (
    pipeline   text    NOT NULL,
    txid       bigint  NOT NULL,
    state_name text    NOT NULL,  -- the topology's sink (StateSpec.source_name)
    keys       bigint  NOT NULL,
    total      numeric NOT NULL,
    digest     numeric NOT NULL,
    PRIMARY KEY (pipeline, txid, state_name)
);

-- The first txid whose commit records its contributions (a txid without a row for a state
-- added nothing to it). Pipelines registered before this migration: the txid after their
-- last committed one (a transaction planned before it commits with this code).
ALTER TABLE pipelines ADD COLUMN IF NOT EXISTS contributions_since bigint;
UPDATE pipelines SET contributions_since = last_committed_txid + 1
    WHERE contributions_since IS NULL;
ALTER TABLE pipelines ALTER COLUMN contributions_since SET DEFAULT 1;
ALTER TABLE pipelines ALTER COLUMN contributions_since SET NOT NULL;

-- A begin's time, per attempt: waiting for locks (the coordinator row, a source's partition
-- rows or its writers in flight), indexing new source data (a landing folder's files), and
-- planning (the rest). NULL: an attempt begun before this migration.
ALTER TABLE transaction_attempts ADD COLUMN IF NOT EXISTS begin_lock_s double precision;
ALTER TABLE transaction_attempts ADD COLUMN IF NOT EXISTS begin_index_s double precision;
ALTER TABLE transaction_attempts ADD COLUMN IF NOT EXISTS begin_plan_s double precision;

-- A range check reads the rejected records its txids kept.
CREATE INDEX IF NOT EXISTS rejected_records_txid ON rejected_records (pipeline, txid);
