-- Issue 39: the commit is the serial point, so what a batch adds to each count state
-- (batch_contributions) is summed per processing group when the group stages, and the commit
-- only adds up its groups' figures. Written with the group's marker (staged_groups), in the
-- same transaction and under the same (txid, attempt, grp) key: a re-staged group replaces
-- its own figure. Logged, like the marker: the figure outlives a crash as the marker does
-- (the commit's proof finds staged rows a crash took). keys: the group's rows for the sink
-- (one per key: processing sums each group's deltas by key); total and digest as in
-- batch_contributions.
CREATE TABLE IF NOT EXISTS staged_contributions (
    pipeline   text    NOT NULL,
    txid       bigint  NOT NULL,
    attempt    integer NOT NULL,
    grp        integer NOT NULL,
    state_name text    NOT NULL,
    keys       bigint  NOT NULL,
    total      numeric NOT NULL,
    digest     numeric NOT NULL,
    PRIMARY KEY (pipeline, txid, attempt, grp, state_name)
);

-- Groups staged before this migration and not yet committed: their figures, from their rows.
INSERT INTO staged_contributions (pipeline, txid, attempt, grp, state_name, keys, total, digest)
SELECT pipeline, txid, attempt, grp, state_name, count(*), sum(delta),
       sum(hashtextextended(key COLLATE "C", 0)::numeric * delta)
FROM staged_deltas
GROUP BY pipeline, txid, attempt, grp, state_name
ON CONFLICT DO NOTHING;
