-- Issue 37: status, backfill and repair check a pipeline's bookkeeping against itself
-- (onceflow.ops.bookkeeping) without a pass over its whole history:
-- each partition's last committed range, found from the newest txid down;
CREATE INDEX IF NOT EXISTS batch_ranges_partition_txid ON batch_ranges (pipeline, partition, txid);
-- transactions without the commit's time stamp: the open ones, and any marked committed by
-- hand without a commit (a commit writes committed_at with the state).
CREATE INDEX IF NOT EXISTS transactions_unstamped
    ON transactions (pipeline, txid) WHERE committed_at IS NULL;
