-- Issue 40: how far behind the source each transaction was planned, for the view's lag over
-- time. `backlog`: the records of the source past the end of the txid's batch when begin
-- planned it, as far as begin looked (a source that stops looking once a batch is full gives
-- a lower bound). Null for transactions planned before this migration.
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS backlog bigint;
