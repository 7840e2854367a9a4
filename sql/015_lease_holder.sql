-- Issue 37: who holds a planned transaction. Every report of an attempt's lease (a running
-- task, a deferred commit's trigger) records the host and pid it came from, so `onceflow
-- status` names the process a txid waits on, not only its run.
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS holder text;
