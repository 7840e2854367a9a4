-- Issue 6: the key-value state of stateful bolts (onceflow/kvstate, PostgreSQL provider).
-- A state is (pipeline, bolt); namespace is its shard. Values are jsonb: SQL NULL means "no
-- value" (absent / deleted), the jsonb 'null' is a stored JSON null. The same statements
-- create these tables in a state database other than the coordinator's.

-- Committed state, opaque: value is the key's value after txid, prev_value before txid.
CREATE TABLE IF NOT EXISTS kv_state (
    pipeline   text   NOT NULL,
    bolt       text   NOT NULL,
    namespace  text   NOT NULL,
    key        text   NOT NULL,
    txid       bigint NOT NULL CHECK (txid > 0),
    value      jsonb,
    prev_value jsonb,
    PRIMARY KEY (pipeline, bolt, namespace, key)
);
-- A replay of txid T finds the keys an earlier attempt of T committed (to put them back first);
-- commit(T) drops the deleted keys of lower txids. txid leads so that a lookup by key can only
-- use the primary key: on a table without statistics yet the planner would otherwise take the
-- (pipeline, bolt) prefix of this index and filter on the key.
CREATE INDEX IF NOT EXISTS kv_state_txid ON kv_state (txid, pipeline, bolt);
CREATE INDEX IF NOT EXISTS kv_state_deleted ON kv_state (pipeline, bolt, txid)
    WHERE value IS NULL;

-- Prepared changes, per attempt: value NULL deletes the key. part: which processing task
-- prepared it (a retried task replaces its own part only).
CREATE TABLE IF NOT EXISTS kv_state_prepared (
    pipeline  text    NOT NULL,
    bolt      text    NOT NULL,
    txid      bigint  NOT NULL,
    attempt   integer NOT NULL,
    namespace text    NOT NULL,
    key       text    NOT NULL,
    value     jsonb,
    part      integer NOT NULL DEFAULT 0,
    PRIMARY KEY (pipeline, bolt, txid, attempt, namespace, key)
);

-- One row per prepared (attempt, part), also when it has no changes: commit and recovery
-- know from it that the attempt prepared.
CREATE TABLE IF NOT EXISTS kv_state_attempts (
    pipeline    text        NOT NULL,
    bolt        text        NOT NULL,
    txid        bigint      NOT NULL,
    attempt     integer     NOT NULL,
    part        integer     NOT NULL,
    changes     integer     NOT NULL,
    prepared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, bolt, txid, attempt, part)
);

-- The last attempt committed to the state: committing it again is a no-op, and no stored
-- txid is above committed_txid.
CREATE TABLE IF NOT EXISTS kv_state_bolts (
    pipeline          text        NOT NULL,
    bolt              text        NOT NULL,
    committed_txid    bigint      NOT NULL DEFAULT 0,
    committed_attempt integer     NOT NULL DEFAULT 0,
    committed_at      timestamptz,
    PRIMARY KEY (pipeline, bolt)
);
