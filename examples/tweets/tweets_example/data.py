"""The demo pipeline's data: tweets that carry a URL, counted per URL and per domain.

The pure-Python side: a seeded event generator, the one definition of a usable tweet
(``parse_event``: what Spark's JSON reader accepts, made explicit), the per-record bolt that
normalizes domains, and an independent recount of the expected state (``recount``, the
pipeline's ``recompute`` for `onceflow verify --recount`). The Spark side (topology.py) must
agree with it record by record; a property test checks that it does, on fuzzed payloads.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# The host of an http(s) URL. topology.py applies the same pattern with Spark's
# regexp_extract (Java regex); re.ASCII gives \s Java's meaning ([ \t\n\x0B\f\r]).
URL_HOST = r"^https?://([^/:?#\s]+)"
_URL_HOST = re.compile(URL_HOST, re.ASCII)
# Spark's JSON reader (Jackson) refuses a document nested deeper than this.
MAX_DEPTH = 1000
_JSON_SPACE = " \t\n\r"
_DECODER = json.JSONDecoder()

ERR_MALFORMED = "malformed JSON"
ERR_NO_URL = "missing field: url"
ERR_BAD_URL = "url is not an http(s) URL"
ERR_OVERSIZED = "oversized record"
DEFAULT_MAX_BYTES = 64 * 1024

_DOMAINS = [
    "news.example.com", "blog.example.org", "www.example.net", "shop.example.io",
    "video.example.tv", "docs.example.dev", "photos.example.app", "wiki.example.edu",
    "sports.example.co", "music.example.fm", "code.example.dev", "maps.example.com",
]
_WORDS = "look read this great new wow breaking thread today via must see".split()


@dataclass
class Recomputed:
    """Expected state per state name, how many records were rejected and why, and how many
    always fail (poison: they must end in the dead letters, or be still queued for replay)."""

    counts: dict[str, Counter] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    failing: Counter = field(default_factory=Counter)
    records: int = 0
    # States whose value per key is a presence, not a sum (first-seen: 1 per URL ever seen):
    # what retention retired merges with what remains by max.
    max_states: frozenset = frozenset({"new_urls"})


class FlakyLookup(RuntimeError):
    """The demo's stand-in for a lookup service that fails now and then."""


def normalize_host(host: str) -> str:
    """A host as IDNA ASCII (what the domain bolt counts). Raises UnicodeError for a host
    IDNA refuses (an empty label as in "a..b", a label over 63 characters): poison input."""
    return host.encode("idna").decode("ascii")


def normalize_domain(values: dict) -> list[dict]:
    """The example topology's per-record Python bolt (spark_tasks/tweets.py): a domain tuple
    -> its normalized key. Fails on a host IDNA refuses (every try: it ends in the dead
    letters), and, to show the backflow at work, on a tweet marked ``"flaky": n`` for its
    first n tries (``_replays`` is how often the record failed before)."""
    flaky = values.get("flaky") or 0
    if values["_replays"] < flaky:
        raise FlakyLookup(f"lookup failed (simulated: fails {flaky} time(s))")
    return [{"key": normalize_host(values["host"])}]


def _depth(text: str) -> int:
    """How deeply ``text`` (one JSON value) nests arrays and objects."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_event(payload: str) -> dict | None:
    """The tweet a payload holds, or None when it is malformed: the one definition, which is
    what Spark's JSON reader (from_json, PERMISSIVE, single quotes refused) accepts for the
    schema ``url string, flaky int``, made explicit:

    - the payload's first JSON value, after JSON whitespace, must be an object; what follows
      it is ignored (Spark reads the first value only);
    - nested at most MAX_DEPTH (1000) deep;
    - ``flaky``, when present and not null, is a 32-bit integer: a field of the wrong type
      makes the whole event malformed (Spark marks the record corrupt);
    - strict JSON otherwise (no comments, no trailing commas, no control characters in
      strings), but NaN and Infinity are numbers, and a lone surrogate escape reads as "?".
    """
    text = payload.lstrip(_JSON_SPACE)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * MAX_DEPTH))
    try:
        doc, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None
    finally:
        sys.setrecursionlimit(limit)
    if not isinstance(doc, dict) or _depth(text[:end]) > MAX_DEPTH:
        return None
    flaky = doc.get("flaky")
    if flaky is not None and not (type(flaky) is int and -(2 ** 31) <= flaky < 2 ** 31):
        return None
    url = doc.get("url")
    if isinstance(url, str):
        doc["url"] = url.encode("utf-8", "replace").decode("utf-8")  # lone surrogates: "?"
    return doc


def classify(payload: str) -> tuple[str, str] | str:
    """(url, host) for a usable tweet, else the rejection error. (Oversized payloads never
    get here: the spout rejects them, see recount.)"""
    doc = parse_event(payload)
    if doc is None:
        return ERR_MALFORMED
    url = doc.get("url")
    if url is None:
        return ERR_NO_URL
    match = _URL_HOST.match(url) if isinstance(url, str) else None
    if match is None:
        return ERR_BAD_URL
    return url, match.group(1).lower()


def _storable(key: str, max_key_bytes: int) -> bool:
    """What the framework's sinks accept as a state key (else the record fails)."""
    return "\x00" not in key and len(key.encode("utf-8")) <= max_key_bytes


def recount(payloads: Iterable[str], pipeline=None) -> Recomputed:
    """The expected state of ``payloads``, independently of Spark and of onceflow's tables."""
    max_bytes = pipeline.source.max_record_bytes if pipeline is not None else DEFAULT_MAX_BYTES
    max_key = pipeline.max_key_bytes if pipeline is not None else 2000
    out = Recomputed(counts={"url_counts": Counter(), "domain_counts": Counter()})
    for payload in payloads:
        out.records += 1
        if len(payload.encode("utf-8", "replace")) > max_bytes:
            out.rejected[ERR_OVERSIZED] += 1
            continue
        result = classify(payload)
        if isinstance(result, str):
            out.rejected[result] += 1
            continue
        url, domain = result
        try:
            domain = normalize_host(domain)
        except UnicodeError as exc:
            out.failing[f"{type(exc).__name__}: {exc}"] += 1
            continue
        if not (_storable(url, max_key) and _storable(domain, max_key)):
            out.failing["state key not storable"] += 1
            continue
        out.counts["url_counts"][url] += 1
        out.counts["domain_counts"][domain] += 1
    # first-seen detection (tweets_first_seen): every URL ever counted, emitted exactly once
    out.counts["new_urls"] = Counter(dict.fromkeys(out.counts["url_counts"], 1))
    return out


def _malformed(rng: random.Random, good: str) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return good[: rng.randrange(1, len(good) - 1)]  # truncated JSON
    if kind == 1:
        return json.dumps({"user": "u0", "text": "no link here"})
    if kind == 2:
        return json.dumps({"user": "u0", "text": "bad link", "url": "ftp//not-a-url"})
    return json.dumps({"user": "u0", "text": "null link", "url": None})


def generate(count: int, *, seed: int = 42, malformed_share: float = 0.02,
             poison_share: float = 0.0005, flaky_share: float = 0.001,
             start_id: int = 0) -> Iterator[str]:
    """``count`` tweet payloads. URLs follow a skewed distribution (a few are very popular).

    ``malformed_share``: unusable tweets (rejected); ``poison_share``: tweets whose URL host
    the domain bolt cannot normalize (they fail every try and end in the dead letters);
    ``flaky_share``: tweets whose lookup fails their first 1-2 tries (replayed, then counted).
    """
    for name, share in (("malformed_share", malformed_share), ("poison_share", poison_share),
                        ("flaky_share", flaky_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name}={share!r} must be between 0 and 1")
    rng = random.Random(seed)
    odd = random.Random(seed + 1)  # poison and flaky picks: the other draws stay as they were
    for i in range(start_id, start_id + count):
        domain = _DOMAINS[min(int(rng.paretovariate(1.2)) - 1, len(_DOMAINS) - 1)]
        path = min(int(rng.paretovariate(0.8)), 5000)
        doc = {"id": i, "user": f"u{rng.randrange(10_000)}"}
        roll = odd.random()
        if roll < poison_share:
            domain = domain.replace(".", "..", 1)  # an empty label: IDNA refuses it
        elif roll < poison_share + flaky_share:
            doc["flaky"] = odd.randint(1, 2)
        url = f"https://{domain}/p/{path}"
        doc.update(text=f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {url}", url=url)
        good = json.dumps(doc)
        yield _malformed(rng, good) if rng.random() < malformed_share else good
