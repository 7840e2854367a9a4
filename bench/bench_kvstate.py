"""Cost of the key-value state of stateful bolts (onceflow.kvstate), per provider.

    python bench/bench_kvstate.py --keys 100000 --changes 10000

Per provider it prints:
- seed: prepare + commit of --keys new keys (txid 1);
- prefetch: a KeyValueState over all --keys keys, read in one round trip;
- get+put: read-modify-write of every key inside the batch (no store access: the bolt's loop);
- lazy get: keys not prefetched, one round trip each (--lazy keys);
- prepare / commit of --changes changed keys (a txid of its own, --rounds times, median);
- replay commit: the same, when an earlier attempt of the txid already reached the store (keys
  it wrote and the replay does not change are put back).

PostgreSQL: ONCEFLOW_PG_DSN's server (else the one on 127.0.0.1:5432), a database of its own
(onceflow_bench_kv, dropped at the start). Redis: --redis-host/--redis-port (a key prefix of
its own, deleted at the end).
"""

from __future__ import annotations

import argparse
import statistics
import uuid

import redis
from benchkit import migrated_database, server_dsn, timed

from onceflow.core.txlog import TransactionAttempt
from onceflow.kvstate import KeyValueState, open_provider

PIPELINE, BOLT, NS = "bench", "counter", "s0"


def bench(provider, args) -> dict[str, str]:
    keys = [f"url-{i:07d}" for i in range(args.keys)]
    out = {}
    seconds, _ = timed(lambda: provider.prepare(
        PIPELINE, BOLT, TransactionAttempt(1, 1), [(NS, k, 1) for k in keys]))
    commit_s, _ = timed(lambda: provider.commit(PIPELINE, BOLT, TransactionAttempt(1, 1)))
    out["seed"] = f"{args.keys:,} keys: prepare {seconds:.2f}s, commit {commit_s:.2f}s"

    seconds, view = timed(lambda: KeyValueState(provider, PIPELINE, BOLT, NS, 2, prefetch=keys))
    out["prefetch"] = f"{args.keys:,} keys in {seconds:.2f}s ({args.keys / seconds:,.0f} keys/s)"

    def loop():
        for key in keys:
            view.put(key, view.get(key, 0) + 1)

    seconds, _ = timed(loop)
    out["get+put"] = (f"{args.keys:,} pairs in {seconds:.2f}s "
                      f"({args.keys / seconds:,.0f} get+put/s)")

    lazy = KeyValueState(provider, PIPELINE, BOLT, NS, 2)
    seconds, _ = timed(lambda: [lazy.get(k) for k in keys[:args.lazy]])
    out["lazy get"] = f"{seconds / args.lazy * 1e6:,.0f} us per key ({args.lazy:,} keys)"
    view.prepare(1)
    provider.commit(PIPELINE, BOLT, TransactionAttempt(2, 1))

    prepares, commits, replays = [], [], []
    txid = 3
    for r in range(args.rounds):
        changed = keys[r * args.changes % args.keys:][:args.changes]
        changes = [(NS, k, r) for k in changed]
        ta = TransactionAttempt(txid, 1)
        prepares.append(timed(lambda ta=ta, c=changes: provider.prepare(PIPELINE, BOLT, ta, c))[0])
        commits.append(timed(lambda ta=ta: provider.commit(PIPELINE, BOLT, ta))[0])
        # Attempt 2 of the same txid: half the keys, so the other half is put back.
        ta2 = TransactionAttempt(txid, 2)
        provider.prepare(PIPELINE, BOLT, ta2, changes[: len(changes) // 2])
        replays.append(timed(lambda ta=ta2: provider.commit(PIPELINE, BOLT, ta))[0])
        txid += 1
    med = statistics.median
    out["prepare"] = f"{args.changes:,} changes: {med(prepares) * 1000:,.0f} ms"
    out["commit"] = f"{args.changes:,} changes: {med(commits) * 1000:,.0f} ms"
    out["replay commit"] = (f"{args.changes // 2:,} changes + {args.changes - args.changes // 2:,}"
                            f" put back: {med(replays) * 1000:,.0f} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--changes", type=int, default=10_000)
    parser.add_argument("--lazy", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--providers", default="memory,postgres,redis")
    parser.add_argument("--redis-host", default="127.0.0.1")
    parser.add_argument("--redis-port", type=int, default=6379)
    args = parser.parse_args()

    server, how = server_dsn()
    dsn = migrated_database(server, "onceflow_bench_kv")
    prefix = f"onceflow-bench-{uuid.uuid4().hex[:8]}:"
    configs = {
        "memory": None,
        "postgres": None,
        "redis": {"host": args.redis_host, "port": args.redis_port, "key_prefix": prefix},
    }
    print(f"PostgreSQL: {how}; {args.keys:,} keys, {args.changes:,} changes per txid")
    try:
        for name in args.providers.split(","):
            provider = open_provider(name, configs[name], coordinator_dsn=dsn)
            try:
                figures = bench(provider, args)
            finally:
                provider.close()
            print(f"\n{name}")
            for what, figure in figures.items():
                print(f"  {what:<14} {figure}")
    finally:
        client = redis.Redis(host=args.redis_host, port=args.redis_port)
        leftover = list(client.scan_iter(match=prefix + "*", count=1000))
        if leftover:
            client.delete(*leftover)
        client.close()


if __name__ == "__main__":
    main()
