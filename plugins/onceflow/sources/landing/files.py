"""What the landing folder's modules share, its declaration and status included: a chunk as the
manifest holds it, and the fixes its refusals name (no pyarrow: its file system is
onceflow.sources.landing.storage)."""

from __future__ import annotations

from typing import NamedTuple

# What a refusal of a changed file tells the user to run (status matches it in failures).
REPAIR_HINT = "`onceflow repair` says what changed and how to go on"


# What to do with a file set aside at indexing (status and repair say it).
SET_ASIDE_FIX = ("land a copy that matches source.schema under a new name (this file is "
                 "never read), or declare the schema it has")


class Chunk(NamedTuple):
    """A chunk as the readers get it (LandingFolder._chunks). ``size`` and ``mtime``: its
    file's, compared only when ``crc`` is None (a chunk indexed before chunk checksums);
    ``checksum``: a Parquet file's footer CRC-32."""

    path: str
    size: int | None
    mtime: float | None
    first: int
    start: int
    end: int
    records: int
    partition: int
    crc: int | None
    void: str | None
    checksum: str | None = None
