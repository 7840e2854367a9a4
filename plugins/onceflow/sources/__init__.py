"""Sources: the Source interface (base) and the sources onceflow ships: the PostgreSQL log
(pglog) and file segments (segments), both kept in the catalog of logs (catalog); a landing
folder of JSON-lines, CSV or Parquet files (landing); a user's own PostgreSQL table read by
its increasing key (table)."""

from onceflow.core.source import Position, Source

__all__ = ["Position", "Source"]
