-- Issue 49: what the source watcher of a keep-up pipeline last did, so that status and the
-- onceflow view can say whether a triggerer runs it. One row per pipeline, written by the
-- watcher (onceflow.core.keepup.record_watch): when it last looked and from which process,
-- its last event and why, and the DAG's runs as Airflow counted them at that look.
CREATE TABLE IF NOT EXISTS source_watchers (
    pipeline       text             PRIMARY KEY REFERENCES pipelines (name) ON DELETE CASCADE,
    holder         text             NOT NULL,
    watch_interval double precision NOT NULL,
    looked_at      timestamptz      NOT NULL,
    event_at       timestamptz,
    event_reason   text,
    runs_active    integer,
    runs_waiting   integer,
    max_runs       integer
);
