-- Issue 14: the table source (onceflow.sources.table), a user's own table read by an
-- increasing key. Per topic: the table and key column it is bound to, and its head (keys below
-- it are final). A candidate head waits in pending_head until every transaction that held the
-- key's sequence when it was chosen (pending_on: their virtual transaction ids) has ended.
CREATE TABLE IF NOT EXISTS table_source_bounds (
    topic         text        PRIMARY KEY,
    relation      text        NOT NULL,
    key_column    text        NOT NULL,
    head          bigint      NOT NULL DEFAULT 0 CHECK (head >= 0),
    pending_head  bigint,
    pending_on    text[],
    pending_since timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CHECK (pending_head IS NULL OR pending_head >= head)
);
