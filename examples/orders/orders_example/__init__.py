"""onceflow's orders example: a user's package with typed state, an upsert and an append
table, read from the user's own PostgreSQL table (written by concurrent writers that commit
out of order) or from Parquet files dropped into a landing folder."""
