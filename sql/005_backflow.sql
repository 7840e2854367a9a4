-- Issue 5: the acker's verdicts at commit, backflow queues and dead letters.

-- The two backflow queues (0 and 1) of a pipeline: which one is "to" (read first by planning)
-- and which "from" (where commits write failed records). A swap flips to_queue: no copying.
CREATE TABLE IF NOT EXISTS backflow_pointers (
    pipeline   text        PRIMARY KEY REFERENCES pipelines (name),
    to_queue   smallint    NOT NULL DEFAULT 1 CHECK (to_queue IN (0, 1)),
    swaps      bigint      NOT NULL DEFAULT 0,
    swapped_at timestamptz
);

-- A failed record waiting to be replayed. One row per source record (its origin position), so
-- a record is never in both queues, nor twice in one. claimed_txid: the transaction whose batch
-- holds it (planning never gives it to another); the commit of that txid consumes it.
CREATE TABLE IF NOT EXISTS backflow_items (
    pipeline     text        NOT NULL REFERENCES pipelines (name),
    partition    integer     NOT NULL,
    "offset"     bigint      NOT NULL,
    queue        smallint    NOT NULL CHECK (queue IN (0, 1)),
    payload      text        NOT NULL,
    failures     integer     NOT NULL CHECK (failures >= 0), -- failed tries so far
    errors       text[]      NOT NULL,                       -- one per failed try, oldest first
    first_txid   bigint      NOT NULL,                       -- the txid of the first failure
    last_txid    bigint      NOT NULL,                       -- the txid of the last failure
    claimed_txid bigint,
    claimed_grp  integer,
    queued_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, partition, "offset")
);
CREATE INDEX IF NOT EXISTS backflow_items_queue ON backflow_items (pipeline, queue, claimed_txid);
CREATE INDEX IF NOT EXISTS backflow_items_claims ON backflow_items (pipeline, claimed_txid)
    WHERE claimed_txid IS NOT NULL;

INSERT INTO backflow_pointers (pipeline) SELECT name FROM pipelines ON CONFLICT DO NOTHING;

-- Records that failed more than max_replays times: never replayed again unless a user puts
-- them back (`onceflow replay-dead-letters`) after fixing the cause.
CREATE TABLE IF NOT EXISTS dead_letters (
    pipeline  text        NOT NULL REFERENCES pipelines (name),
    partition integer     NOT NULL,
    "offset"  bigint      NOT NULL,
    payload   text        NOT NULL,
    failures  integer     NOT NULL,
    errors    text[]      NOT NULL,
    txid      bigint      NOT NULL,  -- the commit that gave up on it
    dead_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, partition, "offset")
);

-- Roots whose tuple tree failed (or did not complete) in one processing group of an attempt.
CREATE UNLOGGED TABLE IF NOT EXISTS staged_failures (
    pipeline  text    NOT NULL,
    txid      bigint  NOT NULL,
    attempt   integer NOT NULL,
    grp       integer NOT NULL,
    partition integer NOT NULL,
    "offset"  bigint  NOT NULL,
    replayed  boolean NOT NULL,  -- came from the to-queue (else from eden, the source)
    payload   text    NOT NULL,
    error     text    NOT NULL,
    PRIMARY KEY (pipeline, txid, attempt, grp, partition, "offset", replayed)
);

-- Successfully replayed records whose source row retention had deleted meanwhile: verify
-- recomputes them from here (they are counted in the state, no longer in the source).
CREATE TABLE IF NOT EXISTS replayed_retired (
    pipeline  text    NOT NULL,
    partition integer NOT NULL,
    "offset"  bigint  NOT NULL,
    payload   text    NOT NULL,
    txid      bigint  NOT NULL,
    PRIMARY KEY (pipeline, partition, "offset")
);

ALTER TABLE staged_groups ADD COLUMN IF NOT EXISTS failed integer NOT NULL DEFAULT 0;
ALTER TABLE staged_groups ADD COLUMN IF NOT EXISTS replayed integer NOT NULL DEFAULT 0;
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS replayed integer NOT NULL DEFAULT 0;
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS failed integer;
