-- Where each pipeline's topic lives (Source.identity: its kind, and for a Kafka topic its
-- connection): a topic's name alone is shared by sources of every kind, so a Kafka topic
-- named as a file segments' or a log's topic would otherwise be checked against the offsets
-- of pipelines that never read it. Registration sets it; NULL: not registered since this
-- migration (such a pipeline is counted by every source of its topic, as before).
ALTER TABLE pipelines ADD COLUMN IF NOT EXISTS source text;
