"""One definition of a usable tweet: the Spark parse bolt and the Python recount
(tweets_example.data.parse_event / classify) agree record by record, on edge cases and on
payloads hypothesis fuzzes (fixed seeds: every run tests the same ones)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tweets_example.data import (
    ERR_BAD_URL,
    ERR_MALFORMED,
    ERR_NO_URL,
    classify,
    generate,
    recount,
)

EDGE_PAYLOADS = [
    # (payload, what the definition says), each a case the outside fault run met or a rule
    ('{"url": "https://News.Example.com/a?b=1#c", "text": "x"}',
     ("https://News.Example.com/a?b=1#c", "news.example.com")),
    ('{"url": "http://h.example:8080/p"}', ("http://h.example:8080/p", "h.example")),
    ('{"url": ', ERR_MALFORMED),
    ("[1, 2]", ERR_MALFORMED),
    ('"just a string"', ERR_MALFORMED),
    ('{"text": "no url"}', ERR_NO_URL),
    ('{"url": null}', ERR_NO_URL),
    ('{"url": 42}', ERR_BAD_URL),
    ('{"url": {"nested": 1}}', ERR_BAD_URL),
    ('{"url": "ftp://x.example/f"}', ERR_BAD_URL),
    ('{"url": "https://"}', ERR_BAD_URL),
    ('{"url": "https://q.example/with,comma \\"quote\\"\\nnewline"}',
     ('https://q.example/with,comma "quote"\nnewline', "q.example")),
    # a non-integer optional field makes the event malformed (Spark marks it corrupt)
    ('{"url": "https://a.example/x", "flaky": "1"}', ERR_MALFORMED),
    ('{"url": "https://a.example/x", "flaky": 1.0}', ERR_MALFORMED),
    ('{"url": "https://a.example/x", "flaky": true}', ERR_MALFORMED),
    ('{"url": "https://a.example/x", "flaky": 2147483648}', ERR_MALFORMED),
    ('{"url": "https://a.example/x", "flaky": -2}', ("https://a.example/x", "a.example")),
    # single quotes are not JSON; what follows the first value is not read
    ("{'url': 'https://a.example/x'}", ERR_MALFORMED),
    ('{"url": "https://a.example/x"} trailing', ("https://a.example/x", "a.example")),
    ('  {"url": "https://a.example/x"}\n', ("https://a.example/x", "a.example")),
    # nesting: Spark's reader refuses a document deeper than 1000
    ('{"url": "https://a.example/x", "d": ' + "[" * 999 + "]" * 999 + "}",
     ("https://a.example/x", "a.example")),
    ('{"url": "https://a.example/x", "d": ' + "[" * 1000 + "]" * 1000 + "}", ERR_MALFORMED),
    ("[" * 5000 + "]" * 5000, ERR_MALFORMED),
    # a lone surrogate escape reads as "?"; a control character inside a string is refused
    ('{"url": "https://a.example/\\ud800"}', ("https://a.example/?", "a.example")),
    ('{"url": "https://a.example/\tx"}', ERR_MALFORMED),
    ('{"url": "https://a.example/x", "n": NaN}', ("https://a.example/x", "a.example")),
    ('{"url": "https://a.\u00a0example/x"}', ("https://a.\u00a0example/x", "a.\u00a0example")),
]


@pytest.mark.parametrize("payload, expected", EDGE_PAYLOADS,
                         ids=[str(i) for i in range(len(EDGE_PAYLOADS))])
def test_the_definition_classifies(payload, expected):
    assert classify(payload) == expected


def spark_says(spark, payloads: list[str]) -> dict[int, object]:
    from tweets_example.topology import parse

    df = spark.createDataFrame([(0, i, p) for i, p in enumerate(payloads)],
                               "partition int, offset long, payload string")
    return {r["offset"]: (r["error"] or (r["url"], r["domain"])) for r in parse(df).collect()}


def test_spark_agrees_on_the_edge_cases_and_generated_tweets(spark):
    payloads = [p for p, _ in EDGE_PAYLOADS] + list(generate(500, seed=3, malformed_share=0.2))
    assert spark_says(spark, payloads) == {i: classify(p) for i, p in enumerate(payloads)}


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 40), 2 ** 40),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_urls = st.one_of(
    st.builds(lambda scheme, host, path: f"{scheme}://{host}/{path}",
              st.sampled_from(["http", "https", "ftp", "HTTP"]),
              st.text(alphabet="abcXYZ.-:?#é \t", min_size=0, max_size=12),
              st.text(max_size=6)),
    _scalars)
_docs = st.fixed_dictionaries(
    {}, optional={"url": _urls, "flaky": _scalars, "text": st.text(max_size=10),
                  "nested": st.recursive(_scalars, lambda c: st.lists(c, max_size=3),
                                         max_leaves=5)})


def _mangle(draw_doc, how: int, tail: str) -> str:
    text = json.dumps(draw_doc, ensure_ascii=how % 2 == 0)
    if how == 2:
        return text[: len(text) // 2]  # truncated
    if how == 3:
        return text.replace('"', "'")  # single quotes
    if how == 4:
        return text + tail  # trailing garbage
    if how == 5:
        return " \n" + text + " "
    return text


_payloads = st.builds(_mangle, _docs, st.integers(0, 7), st.text(max_size=5))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_payloads.filter(bool), min_size=150, max_size=150))
def test_spark_agrees_with_the_definition_on_fuzzed_payloads(spark, payloads):
    assert spark_says(spark, payloads) == {i: classify(p) for i, p in enumerate(payloads)}


def test_the_recount_survives_what_the_pipeline_rejects():
    """A JSON document 5,000 deep once crashed verify with a RecursionError."""
    deep = "{\"a\": " * 5000 + "1" + "}" * 5000
    result = recount([deep, '{"url": "https://a.example/x"}'])
    assert result.rejected[ERR_MALFORMED] == 1 and result.counts["url_counts"] == {
        "https://a.example/x": 1}
