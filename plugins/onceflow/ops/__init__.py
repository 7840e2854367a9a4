"""Operations: the `onceflow` command and what it runs (status, verify, backfill, retention,
repair)."""
