-- Whether a failed attempt's error was permanent (onceflow.core.errors.Permanent: a
-- declaration the data cannot meet, a running total past its declared type, a bad setting):
-- then retrying cannot help until its cause is fixed, and `onceflow status` says so instead
-- of suggesting a re-run. NULL: not known (an attempt that ended before this column).
ALTER TABLE transaction_attempts ADD COLUMN IF NOT EXISTS permanent boolean;
