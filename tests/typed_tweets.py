"""The typed-records case that every source decoding a ``json_schema`` runs through (the
landing folder's tests, the segments' tests): the tweets example's typed topology over 1,000
tweets with malformed, poison and flaky ones, one payload over 4,096 bytes (index 10) and one
with a wrongly typed field (index 30)."""

from __future__ import annotations

import json

from onceflow.core.registry import get_pipeline
from tweets_example.data import generate
from tweets_example.topology import SCHEMA

__all__ = ["MAX_RECORD_BYTES", "SCHEMA", "payloads", "pipeline"]

MAX_RECORD_BYTES = 4096


def pipeline(name: str, source):
    """Pipeline ``name`` of the tweets example reading ``source`` with the typed topology."""
    return get_pipeline(name, source=source, batch_size=700,
                        topology="tweets_example.topology:topology_typed")


def payloads() -> list[str]:
    out = list(generate(1000, seed=11, malformed_share=0.05, poison_share=0.01,
                        flaky_share=0.03))
    out[10] = json.dumps({"url": "https://big.example/" + "x" * 5000})
    out[30] = json.dumps({"url": "https://typed.example/1", "flaky": "one"})
    return out
