-- Issue 39: the commit applies each state on its own, so staged deltas are found by state:
-- a state's apply reads its own rows only, not every row of the attempt.
DROP INDEX IF EXISTS staged_deltas_attempt;
CREATE INDEX IF NOT EXISTS staged_deltas_state
    ON staged_deltas (pipeline, txid, attempt, state_name, grp);
