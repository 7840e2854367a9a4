-- Issue 3: attempts, adoption of failed / superseded transactions, attempt history.

-- Every attempt of every transaction: which run made it and how it ended.
CREATE TABLE IF NOT EXISTS transaction_attempts (
    pipeline   text        NOT NULL,
    txid       bigint      NOT NULL,
    attempt    integer     NOT NULL,
    run_id     text,
    started_at timestamptz NOT NULL DEFAULT now(),
    outcome    text        CHECK (outcome IN ('committed', 'failed', 'superseded', 'fenced')),
    reason     text,
    ended_at   timestamptz,
    PRIMARY KEY (pipeline, txid, attempt),
    FOREIGN KEY (pipeline, txid) REFERENCES transactions (pipeline, txid)
);

-- Adoption looks for the lowest failed or superseded txid of a pipeline.
CREATE INDEX IF NOT EXISTS transactions_open
    ON transactions (pipeline, txid) WHERE state <> 'committed';

-- How often a txid's batch was re-planned (opaque mode only).
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS replans integer NOT NULL DEFAULT 0;

-- Attempts made before this migration.
INSERT INTO transaction_attempts (pipeline, txid, attempt, run_id, started_at, outcome, ended_at)
SELECT pipeline, txid, attempt, run_id, planned_at,
       CASE WHEN state = 'committed' THEN 'committed' END, committed_at
FROM transactions
ON CONFLICT DO NOTHING;
