"""The Redis provider. One state (pipeline, bolt) is a family of keys sharing the hash tag
``{pipeline/bolt}`` (so it would stay in one slot), under ``key_prefix``; ``F`` is a key's
field (its serialized key), ``M`` a member naming (namespace, F) as ``<len(ns)>:<ns><F>``:

    P:r:<ns>           hash F -> record "<txid>|<len v>|<len p>|<v><p>": the txid that last
                       wrote the key, its value after (v) and before (p) that txid, JSON text;
                       a length of -1 means "no value" (JSON null is the text null)
    P:touched:<txid>   set of M written by that txid              (a replay puts back the rest)
    P:deleted:<txid>   set of M deleted by that txid              (purged once it cannot replay)
    P:txids            sorted set of txids that have such sets
    P:prep:<txid>:<attempt>:<part>   hash M -> JSON, or "" for a delete
    P:attempts         hash "<txid>:<attempt>:<part>" -> number of changes (prepared only)
    P:meta             hash txid, attempt: the last attempt committed here

Commit is one Lua script, so Redis applies an attempt entirely or not at all (it checks
everything before its first write: a script's writes are not undone by a later error). JSON
text is written with ASCII escapes, so the record's lengths are the same in bytes (Lua) and in
characters (Python), and Lua cuts the record without ever decoding JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from onceflow.core.txlog import TransactionAttempt
from onceflow.kvstate.base import (
    DELETED,
    Change,
    NotPrepared,
    Provider,
    RecoveryNeeded,
    StaleBatch,
    as_of,
    check_name,
    dedupe,
    log,
)

_CHUNK = 10_000

_COMMIT = r"""
local meta, attempts, txids = KEYS[1], KEYS[2], KEYS[3]
local base, Ts, A = ARGV[1], ARGV[2], ARGV[3]
local T = tonumber(Ts)
local ct = tonumber(redis.call('HGET', meta, 'txid') or '0')
local ca = redis.call('HGET', meta, 'attempt') or '0'

local parts, lower = {}, {}
for _, f in ipairs(redis.call('HKEYS', attempts)) do
  local t, a, p = string.match(f, '^(%d+):(%d+):(%-?%d+)$')
  if tonumber(t) == T and a == A then parts[#parts + 1] = p
  elseif tonumber(t) < T then lower[#lower + 1] = t .. '/' .. a end
end
local function drop_mine()
  for _, p in ipairs(parts) do
    redis.call('DEL', base .. ':prep:' .. Ts .. ':' .. A .. ':' .. p)
    redis.call('HDEL', attempts, Ts .. ':' .. A .. ':' .. p)
  end
end
if (ct == T and ca == A) or (ct > T and #parts == 0) then
  drop_mine()
  return {'noop', 0, 0}
end
if #parts == 0 then return {'missing', 0, 0} end
if ct > T then return {'stale', ct, 0} end
if #lower > 0 then return {'recovery', table.concat(lower, ', '), 0} end

local changes, order = {}, {}
for _, p in ipairs(parts) do
  local flat = redis.call('HGETALL', base .. ':prep:' .. Ts .. ':' .. A .. ':' .. p)
  for i = 1, #flat, 2 do
    if changes[flat[i]] ~= nil then return {'duplicate', flat[i], p} end
    changes[flat[i]] = flat[i + 1]
    order[#order + 1] = flat[i]
  end
end

local function split(m)
  local colon = string.find(m, ':', 1, true)
  local n = tonumber(string.sub(m, 1, colon - 1))
  return string.sub(m, colon + 1, colon + n), string.sub(m, colon + n + 1)
end
-- A record: txid, value (false: none), prev (false: none).
local function unpack(r)
  if not r then return 0, false, false end
  local a = string.find(r, '|', 1, true)
  local b = string.find(r, '|', a + 1, true)
  local c = string.find(r, '|', b + 1, true)
  local vl, pl = tonumber(string.sub(r, a + 1, b - 1)), tonumber(string.sub(r, b + 1, c - 1))
  local v, p, pos = false, false, c + 1
  if vl >= 0 then v = string.sub(r, pos, pos + vl - 1); pos = pos + vl end
  if pl >= 0 then p = string.sub(r, pos, pos + pl - 1) end
  return tonumber(string.sub(r, 1, a - 1)), v, p
end
local function pack(v, p)
  return Ts .. '|' .. (v and #v or -1) .. '|' .. (p and #p or -1) .. '|' .. (v or '') .. (p or '')
end

-- Checks are done; writes from here on.
local touched, deleted = base .. ':touched:' .. Ts, base .. ':deleted:' .. Ts
local reverted = 0
if ct == T then  -- an earlier attempt of T committed here: put back what this one leaves
  for _, m in ipairs(redis.call('SMEMBERS', touched)) do
    if changes[m] == nil then
      local ns, f = split(m)
      local rh = base .. ':r:' .. ns
      local t, _, p = unpack(redis.call('HGET', rh, f))
      if t == T then
        if p then redis.call('HSET', rh, f, pack(p, p)) else redis.call('HDEL', rh, f) end
        reverted = reverted + 1
      end
    end
  end
end

for _, m in ipairs(order) do
  local ns, f = split(m)
  local rh = base .. ':r:' .. ns
  local t, v, p = unpack(redis.call('HGET', rh, f))
  if t < T then p = v end  -- (t == T: p already holds the value before T)
  v = changes[m]
  if v == '' then v = false end
  if not v and not p then
    redis.call('HDEL', rh, f)  -- no value before T nor after: nothing to remember
  else
    redis.call('HSET', rh, f, pack(v, p))
    redis.call('SADD', touched, m)
    if not v then redis.call('SADD', deleted, m) end
  end
end

-- Ordered commit: no txid below T is replayed once T commits. Its deleted keys go, and so do
-- the sets that only a replay would need.
for _, old in ipairs(redis.call('ZRANGEBYSCORE', txids, '-inf', '(' .. Ts)) do
  for _, m in ipairs(redis.call('SMEMBERS', base .. ':deleted:' .. old)) do
    local ns, f = split(m)
    local rh = base .. ':r:' .. ns
    local t, v = unpack(redis.call('HGET', rh, f))
    if t == tonumber(old) and not v then redis.call('HDEL', rh, f) end
  end
  redis.call('UNLINK', base .. ':touched:' .. old, base .. ':deleted:' .. old)
end
redis.call('ZREMRANGEBYSCORE', txids, '-inf', '(' .. Ts)
redis.call('ZADD', txids, T, Ts)
redis.call('HSET', meta, 'txid', Ts, 'attempt', A)
drop_mine()
return {'ok', #order, reverted}
"""


class RedisProvider(Provider):
    name = "redis"

    def __init__(self, client: redis.Redis, *, key_prefix: str, key_serializer: str):
        self._r = client
        self._prefix = key_prefix
        self._json_keys = key_serializer == "json"
        self._commit_script = client.register_script(_COMMIT)

    def close(self) -> None:
        self._r.close()

    # -- naming -------------------------------------------------------------------------------
    def _base(self, pipeline: str, bolt: str) -> str:
        return f"{self._prefix}{{{check_name('pipeline', pipeline)}/{check_name('bolt', bolt)}}}"

    def _field(self, key: str) -> str:
        return json.dumps(key, ensure_ascii=False) if self._json_keys else key

    def _key(self, field: str) -> str:
        return json.loads(field) if self._json_keys else field

    @staticmethod
    def _member(namespace: str, field: str) -> str:
        return f"{len(namespace.encode())}:{namespace}{field}"

    # -- reads --------------------------------------------------------------------------------
    def _visible(self, pairs, txid: int, namespace: str) -> dict[str, Any]:
        """{key: value} as batch ``txid`` sees them, from (field, record or None) pairs."""
        out = {}
        for field, record in pairs:
            if record is None:
                continue
            stored, value_len, prev_len, texts = record.split("|", 3)
            key = self._key(field)
            if as_of(int(stored), txid, f"key {key!r} of {namespace!r}"):
                value_len = int(value_len)
                text = texts[:value_len] if value_len >= 0 else None
            else:
                prev_len = int(prev_len)
                text = texts[len(texts) - prev_len:] if prev_len >= 0 else None
            if text is not None:
                out[key] = json.loads(text)
        return out

    def read(self, pipeline: str, bolt: str, namespace: str, keys: Iterable[str], *,
             txid: int) -> dict[str, Any]:
        fields = [self._field(key) for key in keys]
        rh = f"{self._base(pipeline, bolt)}:r:{namespace}"
        out = {}
        for i in range(0, len(fields), _CHUNK):
            chunk = fields[i:i + _CHUNK]
            out.update(self._visible(zip(chunk, self._r.hmget(rh, chunk), strict=True), txid,
                                     namespace))
        return out

    def scan(self, pipeline: str, bolt: str, namespace: str, *, txid: int
             ) -> Iterator[tuple[str, Any]]:
        rh = f"{self._base(pipeline, bolt)}:r:{namespace}"
        cursor, seen = 0, set()
        while True:
            cursor, page = self._r.hscan(rh, cursor, count=1000)
            pairs = [(f, r) for f, r in page.items() if f not in seen]  # HSCAN may repeat one
            seen.update(page)
            yield from sorted(self._visible(pairs, txid, namespace).items())
            if cursor == 0:
                return

    # -- prepare / commit / rollback ----------------------------------------------------------
    def prepare(self, pipeline: str, bolt: str, ta: TransactionAttempt,
                changes: Iterable[Change], *, part: int = 0) -> int:
        started = time.monotonic()
        base = self._base(pipeline, bolt)
        encoded = {
            self._member(ns, self._field(key)):
                "" if value is DELETED else json.dumps(value, allow_nan=False,
                                                       separators=(",", ":"))
            for (ns, key), value in dedupe(changes).items()
        }
        prep = f"{base}:prep:{int(ta.txid)}:{int(ta.attempt)}:{int(part)}"
        with self._r.pipeline(transaction=True) as pipe:
            # WATCH: a commit of this state between the check and EXEC makes EXEC fail.
            pipe.watch(f"{base}:meta")
            committed = pipe.hmget(f"{base}:meta", ["txid", "attempt"])
            ct, ca = int(committed[0] or 0), int(committed[1] or 0)
            if ct > ta.txid or (ct, ca) == (ta.txid, ta.attempt):
                raise StaleBatch(f"kv state {pipeline}/{bolt}: {ta} cannot prepare: txid {ct} "
                                 f"attempt {ca} is committed already")
            pipe.multi()
            pipe.delete(prep)
            items = list(encoded.items())
            for i in range(0, len(items), _CHUNK):
                pipe.hset(prep, mapping=dict(items[i:i + _CHUNK]))
            pipe.hset(f"{base}:attempts", f"{int(ta.txid)}:{int(ta.attempt)}:{int(part)}",
                      len(encoded))
            pipe.execute()
        log.debug("kv state %s/%s: prepared %s part %d: %d changes (%.3fs)", pipeline, bolt, ta,
                  part, len(encoded), time.monotonic() - started)
        return len(encoded)

    def commit(self, pipeline: str, bolt: str, ta: TransactionAttempt, *, cur=None) -> int:
        self._refuse_cur(cur)
        started = time.monotonic()
        base = self._base(pipeline, bolt)
        where = f"kv state {pipeline}/{bolt}"
        status, detail, reverted = self._commit_script(
            keys=[f"{base}:meta", f"{base}:attempts", f"{base}:txids"],
            args=[base, str(int(ta.txid)), str(int(ta.attempt))])
        if status == "noop":
            log.info("%s: %s is committed already: nothing to do", where, ta)
            return 0
        if status == "missing":
            raise NotPrepared(f"{where}: {ta} has nothing prepared: prepare it (also with no "
                              "changes) before commit")
        if status == "stale":
            raise StaleBatch(f"{where}: {ta} is older than the committed txid {detail}")
        if status == "recovery":
            raise RecoveryNeeded(f"{where}: cannot commit {ta}: attempts {detail} (txid/attempt) "
                                 "of lower txids are still prepared; run recover() first")
        if status == "duplicate":
            raise ValueError(f"{where}: {detail!r} is prepared by two parts of {ta}: a namespace "
                             f"belongs to one part")
        log.info("%s: committed %s: %d changes, %d keys of an earlier attempt put back (%.3fs)",
                 where, ta, detail, reverted, time.monotonic() - started)
        return int(detail)

    def _attempt_fields(self, base: str, txid: int | None = None, attempt: int | None = None
                        ) -> list[tuple[TransactionAttempt, str]]:
        out = []
        for field in self._r.hkeys(f"{base}:attempts"):
            t, a, _part = field.split(":")
            if (txid is None or int(t) == txid) and (attempt is None or int(a) == attempt):
                out.append((TransactionAttempt(int(t), int(a)), field))
        return out

    def rollback(self, pipeline: str, bolt: str, txid: int, attempt: int | None = None) -> int:
        base = self._base(pipeline, bolt)
        fields = [field for _, field in self._attempt_fields(base, txid, attempt)]
        dropped = 0
        if fields:
            pipe = self._r.pipeline(transaction=True)
            for field in fields:
                pipe.hlen(f"{base}:prep:{field}")
                pipe.delete(f"{base}:prep:{field}")
            pipe.hdel(f"{base}:attempts", *fields)
            dropped = sum(pipe.execute()[0:-1:2])
        log.info("kv state %s/%s: rolled back txid %d attempt %s: %d prepared changes dropped",
                 pipeline, bolt, txid, "all" if attempt is None else attempt, dropped)
        return dropped

    def prepared(self, pipeline: str, bolt: str) -> list[TransactionAttempt]:
        return sorted({ta for ta, _ in self._attempt_fields(self._base(pipeline, bolt))})

    def last_committed(self, pipeline: str, bolt: str) -> TransactionAttempt | None:
        txid, attempt = self._r.hmget(f"{self._base(pipeline, bolt)}:meta", ["txid", "attempt"])
        return TransactionAttempt(int(txid), int(attempt)) if txid else None
