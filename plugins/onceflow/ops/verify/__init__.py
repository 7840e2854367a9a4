"""`onceflow verify`: is the committed state exactly what the committed batches imply?

**Re-run** (the default; needs no code from the user): the pipeline's own topology runs again,
in Spark, over everything each committed txid read (its planned ranges and the backflow items
it replayed, with the replay count they had), and the result is compared with:

- every state table, key by key: ``value`` (the sum over txids), ``prev_value`` (the value
  before the key's last txid) and ``txid`` (its last txid);
- the rejected records (the same positions);
- the failed records: each is waiting in a backflow queue, is a dead letter, or was replayed
  by a later committed txid (a parked record the re-run no longer fails is a note).

A try of a record that its commit failed (a later committed txid replayed it, or it is parked)
is compared as failed, whatever the re-run does with it: once its cause is fixed (a type
widened) and it is replayed, the record counts once, where it committed. A txid whose records
cannot be read again (a landed chunk edited in place) is reported with the reason in one line
(its Spark job is split in halves until it is alone) and the others are still checked.

Batches whose records retention deleted cannot run again: then the check is partial (for a
key last written by a batch that re-ran, ``value - prev_value`` equals that batch's delta, and
no re-run batch after it touched the key), and the report says how many txids it covered.
States fed by stateful bolts depend on key-value state and are left to ``--recount``.
Each txid's commit recorded what it added to each count state (batch_contributions: keys,
sum of deltas, digest); the re-run's are compared with them too.

**Range** (``txids=(A, B)``; the CLI's ``--txids A..B`` and ``--last N``): only txids A..B
run again (their ranges and replays, nothing else is read), and:

- each one's contribution to each count state equals what its commit recorded (so the
  commit applied exactly what its batch implies, whatever came later);
- each key a re-run txid writes holds that txid or a later one; each key last written by a
  txid of the range is written by its re-run and (opaque) holds value - prev_value = its
  delta; a typed state likewise (an opaque one: previous values combined with the batch; an
  append table: its rows of A..B as a multiset);
- rejects of A..B, and where each record A..B fails went;
- then, without reading any record, every count state's table against every recorded
  contribution (sum(value) and sum(key_weight(key) * value) in SQL, one pass): a change no
  commit made, anywhere. When the range's own checks are clean, that mismatch is reported as
  outside the range (the range's batches do not explain it).

State is cumulative: a range check does not prove the values before A (a key's prev_value
is taken as it is), nor what txids outside A..B added (their recorded contributions are
trusted; a check of their range proves them).

**Recount** (``--recount``): the pipeline's independent recount function
(``Pipeline.recompute``) over every record below the committed offsets: committed state +
rejects + queued + dead letters == the source. Records retention deleted after they were
committed are accounted for by what retention summed before deleting them (retired_counts);
ranges a policy skipped (offset_gaps) were never read and are left out.
"""

from onceflow.ops.verify.range_check import resolve_range
from onceflow.ops.verify.recount_check import recount
from onceflow.ops.verify.report import VerifyReport
from onceflow.ops.verify.rerun_check import CHUNK_RECORDS, rerun

__all__ = ["CHUNK_RECORDS", "VerifyReport", "recount", "rerun", "resolve_range"]
