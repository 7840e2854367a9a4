-- Issue 11: attempts that stop reporting (their run died) are adopted by the next run; the
-- commit proves its staging is whole; retention never deletes what an open transaction planned.

-- Each running task of the current attempt reports here; an attempt silent for lease_s
-- seconds is abandoned and the next run adopts its txid.
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS heartbeat_at timestamptz;
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS lease_s integer NOT NULL DEFAULT 600
    CHECK (lease_s > 0);
UPDATE transactions SET heartbeat_at = planned_at WHERE heartbeat_at IS NULL;

ALTER TABLE transaction_attempts DROP CONSTRAINT IF EXISTS transaction_attempts_outcome_check;
ALTER TABLE transaction_attempts ADD CONSTRAINT transaction_attempts_outcome_check
    CHECK (outcome IN ('committed', 'failed', 'superseded', 'fenced', 'abandoned'));

-- The stateful bolts whose key-value changes a group prepared: the commit commits exactly
-- these (and needs the topology only when there are some).
ALTER TABLE staged_groups ADD COLUMN IF NOT EXISTS stateful text[] NOT NULL DEFAULT '{}';

-- Retention looks for the lowest offset an open transaction planned, per topic and partition.
CREATE INDEX IF NOT EXISTS batch_ranges_topic ON batch_ranges (topic, partition, start_offset);

-- The replayed part of a committed batch (the backflow items its txid claimed, with the
-- failure count they had when read): with batch_ranges, everything a committed txid read,
-- so that verify can re-run it.
CREATE TABLE IF NOT EXISTS batch_replays (
    pipeline  text    NOT NULL,
    txid      bigint  NOT NULL,
    partition integer NOT NULL,
    "offset"  bigint  NOT NULL,
    replays   integer NOT NULL,
    payload   text    NOT NULL,
    PRIMARY KEY (pipeline, txid, partition, "offset")
);
