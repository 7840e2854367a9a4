-- Issue 40: pipelines that keep up by themselves, and their freshness.

-- When the records of a transaction's batch arrived in the source: its oldest and its newest
-- (onceflow.sources.base.Source.arrivals), written when the batch is planned. The delay from
-- arrival to committed_at is the pipeline's freshness (onceflow.core.freshness). NULL: not
-- known (a batch of replays only, or planned before this column).
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS first_arrival timestamptz;
ALTER TABLE transactions ADD COLUMN IF NOT EXISTS last_arrival timestamptz;

-- How many begins ran for the pipeline (each one under the coordinator's lock): the source
-- watcher counts its events as taken up once a begin ran after them.
ALTER TABLE pipelines ADD COLUMN IF NOT EXISTS begins bigint NOT NULL DEFAULT 0;

-- A segment's records arrived when it was indexed (written or imported). Segments indexed
-- before this column have none (their arrival is not known).
ALTER TABLE source_segments ADD COLUMN IF NOT EXISTS indexed_at timestamptz;
ALTER TABLE source_segments ALTER COLUMN indexed_at SET DEFAULT now();

-- A landed chunk's records arrived when its file was last modified before the look that
-- indexed them (the file's mtime then). NULL: indexed before this column (the file's
-- indexed_at stands in).
ALTER TABLE landing_chunks ADD COLUMN IF NOT EXISTS landed_at timestamptz;

-- Sources that record no arrival time per record (a user's table without a time column):
-- when a head was first seen (by the source watcher or a begin). A record at offset o arrived
-- by the first sighting of a head past o.
CREATE TABLE IF NOT EXISTS source_sightings (
    topic     text        NOT NULL,
    partition integer     NOT NULL,
    head      bigint      NOT NULL,
    seen_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition, head)
);
