"""Sources: the Source interface (base) and the sources onceflow ships: the PostgreSQL log
(pglog) and file segments (segments), both kept in the catalog of logs (catalog)."""

from onceflow.sources.base import Position, Source

__all__ = ["Position", "Source"]
