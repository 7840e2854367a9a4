-- Staged deltas arrive summed by (state, key) per group (Spark aggregates them), so the wide
-- six-column primary key only cost an index insert per row: a narrow index finds an
-- attempt's rows for the commit, the proof and the deletes.
ALTER TABLE staged_deltas DROP CONSTRAINT IF EXISTS staged_deltas_pkey;
CREATE INDEX IF NOT EXISTS staged_deltas_attempt ON staged_deltas (pipeline, txid, attempt, grp);

-- Typed states stage into tables of their own (onceflow.core.tables), made at registration.
CREATE SCHEMA IF NOT EXISTS onceflow_staging;
