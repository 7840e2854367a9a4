"""What can go wrong, by what a user (or Airflow) should do about it.

``Permanent`` errors cannot be fixed by trying again: a bad setting, an unknown txid or
pipeline, a database that cannot be reached with the given settings. Airflow tasks fail them
at once (no retries) and the CLI exits 2. Everything else is a failure of the work itself
(exit 1, retried by Airflow).
"""

from __future__ import annotations


class OnceflowError(Exception):
    """Base of onceflow's own errors."""


class Permanent(OnceflowError):
    """Retrying cannot help: the message says what to change."""


class ConfigError(Permanent, ValueError):
    """Bad configuration: the message names the field, the value and the fix."""


class ImportConflict(Permanent, ValueError):
    """An import holds records at offsets the log already has, with other payloads: refused
    whole (the message names the first conflicting range, the count and the flag)."""
class DeclarationError(ConfigError):
    """A pipeline whose topology, sources and states disagree (a measure on a column no
    stream has, one column name with two types): found before any data, by `onceflow
    pipelines`, `onceflow init`, the DAG's build and every processing."""


class SharedTable(DeclarationError):
    """Two pipelines declare one table (a state, an upsert or an append table): each
    pipeline's txids are its own, so one's replay rule would overwrite or delete the other's
    keys and rows. Refused when the pipelines load together, and by the coordinator's
    database for a table another pipeline registered there."""


class StateOverflow(Permanent):
    """A state's running total outgrew the type its declaration gives the column (a
    numeric(6,2) sum past 9999.99). No record is at fault: the txid cannot commit until the
    column is widened (the declaration and the table)."""


class Unreachable(Permanent, ConnectionError):
    """A database, Redis or Spark that the settings name does not answer."""


class Unavailable(OnceflowError, ConnectionError):
    """A PostgreSQL that refused connections, was starting up or in recovery for as long as
    connecting is retried (``pg_connect_retry_s``): a server that is restarting answers
    again, so Airflow retries the task. The CLI exits 2 with it, as with Unreachable."""


class UnknownTransaction(Permanent, LookupError):
    """A txid that the pipeline never planned."""


class NotInitialised(Permanent, LookupError):
    """The pipeline has no coordinator row: `onceflow init` (or the first begin) makes it."""


class Fenced(OnceflowError):
    """This attempt is no longer its transaction's current one (a zombie or a duplicate run):
    it may not write. Nothing is wrong with the data; the current attempt carries on."""


class MaxPendingReached(OnceflowError):
    """``max_pending`` transactions are planned and uncommitted: no new txid is planned."""


class NothingToPlan(OnceflowError):
    """A run that asked to skip an empty batch (one the source watcher started) found nothing
    to read and no transaction to adopt: it ends without a txid."""


class BookkeepingDamaged(OnceflowError):
    """The pipeline's own records disagree (a commit record or offsets changed by hand):
    nothing that writes is done until `onceflow repair` has fixed them."""


class StaleBatch(OnceflowError):
    """A batch older than what a state already holds: never applied."""


class StagingIncomplete(OnceflowError):
    """The commit found less staged data than processing recorded (e.g. PostgreSQL crashed
    and emptied the unlogged staging tables): the attempt is failed and processed again."""


class SourceChanged(Permanent):
    """Records a source holds changed after they were indexed (a landed file rewritten):
    trying again reads the same changed bytes; `onceflow repair` says what changed and
    accepts or skips it."""


class SourceShortfall(OnceflowError):
    """A planned range could not be read whole (records deleted under a batch)."""


class OffsetOutOfRange(OnceflowError):
    """A resume point was deleted by retention and the policy is "fail"."""


class SparkServerGone(OnceflowError):
    """The Spark Connect server stopped answering in the middle of a task (killed, crashed,
    restarted): the attempt fails within the client's retry bound and is retried like any
    failure of the infrastructure (in local mode the retry starts onceflow's server again)."""


class BlockedByEarlierTxid(OnceflowError):
    """A commit cannot take its turn: an earlier txid failed or its run is gone."""


def is_permanent(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from (an Airflow exception raised from
    one of onceflow's), is Permanent: retrying cannot help until its cause is fixed."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Permanent):
            return True
        seen.add(id(error))
        error = error.__cause__
    return False
