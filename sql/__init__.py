"""onceflow's numbered PostgreSQL migrations, shipped as package data (onceflow.migrations)."""
