"""A user's own PostgreSQL table as the source: not a copy, the table itself, read in ranges of
an increasing integer key fed by a sequence (an identity or serial column).

    TableSource(topic="orders", table="public.orders", key="id")        # the coordinator's DB
    TableSource(topic="orders", table="shop.orders", key="id", conn_id="shop_pg")  # another

**Offsets are key values.** One partition (0); a range ``[start, end)`` reads the rows with
``start <= key < end``. Keys need not be dense (rolled-back inserts, INCREMENT > 1 leave
holes), so ``batch_size`` counts key values, not rows, and a batch may hold fewer rows. Each
record's payload is the row as JSON (``row_to_json``: column names as keys, numbers as
numbers, timestamps as ISO text); a topology parses it with ``from_json``, or the source
decodes it as it reads it (``json_schema``, e.g. ``"url string, amount double"``: the records
then carry these columns and ``_corrupt_record``; a value that breaks its declared type, a
text column declared int, makes the record corrupt). With ``json_schema`` a record is the
declared columns of the row: its payload is the JSON object of those the table has (one it
lacks is absent, so null), wherever it is read (a batch, ``payloads``, ``payloads_at`` for
the backflow, verify), and ``max_record_bytes`` and ``_corrupt_record`` apply to it. One
partition is enough: a range is read by several Spark tasks at once (``read_chunk`` key
values each), so splitting keys over partitions by ``key % N`` would add heads to keep and
nothing to speed.

**The direct read** (onceflow.sources.table.select): with a json_schema whose every column
the table holds in a type Arrow reads exactly as the decoder reads its JSON, a batch copies
the values themselves and builds no JSON. **The head** (onceflow.sources.table.head): a bound
no late commit can fall under, from the sequence's position and the writers holding its lock.
**The checks** (onceflow.sources.table.check): what is refused, loudly, with the fix.

**The rules a writer keeps (onceflow cannot check them cheaply):** rows are append-only for
onceflow (a row updated after it was read is not read again; one deleted is missing from a
re-read, ``verify`` then reports it); keys come from the sequence, drawn in the transaction
that inserts the row (a column default or identity does that; ``GENERATED ALWAYS`` forbids
anything else); no replication or bulk load writes keys the sequence did not hand out; the
source reads the primary (a standby is refused: writers' locks are not there). A
long transaction that used the sequence holds the head back (``status`` shows the lag, the
log names its pid): set ``idle_in_transaction_session_timeout``.

Reading needs no JDBC driver: as for the PostgreSQL log (sources/pglog.py), the ranges are
cut into chunks of ``read_chunk`` key values spread over the Spark tasks; a task streams each
chunk with ``COPY (SELECT ... row_to_json(t) ...) TO STDOUT`` and parses it with Arrow
(``mapInArrow``). The same code runs in local mode, on a cluster and through Spark Connect,
whose sessions cannot load a JDBC driver that was not on their classpath when they started,
and the payload is PostgreSQL's ``row_to_json`` wherever it is read (a batch, ``payloads_at``
for the backflow, verify; with ``json_schema`` the reader task decodes it, or reads the
columns directly, and the backflow and verify decode the same payloads by the same rules).
Spark's JDBC reader reads more rows per second, but building the JSON in PostgreSQL costs
most of either (the figures: docs/design.md); the direct read builds none.
"""

from onceflow.sources.table.source import TableSource

__all__ = ["TableSource"]
