-- Issue 48: which pipeline each state table belongs to (a count or typed state, an upsert
-- or an append table). A table has one pipeline: each pipeline's txids are its own, so two
-- pipelines writing one table would overwrite each other's keys and delete each other's
-- rows. Registration claims a pipeline's tables here and refuses one another pipeline
-- holds. database: '' for the coordinator's own, else the state's connection (conn_id).
CREATE TABLE IF NOT EXISTS state_table_owners (
    database   text        NOT NULL,
    table_name text        NOT NULL,
    pipeline   text        NOT NULL REFERENCES pipelines (name),
    claimed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (database, table_name)
);
