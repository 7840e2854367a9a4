"""Decoded JSON-lines records (onceflow.sources.json_records): the decoder keeps the rules its
plain-Python reference states, on every kind of line, and refuses schemas it cannot decode."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.core.errors import ConfigError
from onceflow.sources.json_records import CORRUPT, JsonRecords, reference_decode
from onceflow.sources.landing import LandingFolder

NUL = "payload holds a NUL character, which PostgreSQL text cannot store"
ALL = JsonRecords("s string, b boolean, t tinyint, h smallint, i int, l bigint, f float, "
                  "d double, `odd-name` string")
NAMES = [name for name, _ in ALL.columns]


def decoded(records: JsonRecords, lines: list[bytes], max_bytes: int | None = None):
    """Per line: None (corrupt), the problem text, or the declared columns' values."""
    columns, problems = records.decode(lines, max_bytes)
    corrupt = columns[CORRUPT].to_pylist()
    values = {name: columns[name].to_pylist() for name in records.names}
    out = []
    for i, problem in enumerate(problems.to_pylist()):
        if problem is not None:
            assert corrupt[i] is None and all(values[n][i] is None for n in records.names)
            out.append(problem)
        elif corrupt[i] is not None:
            assert corrupt[i] == lines[i].decode("utf-8", "replace")
            assert all(values[n][i] is None for n in records.names)
            out.append(None)
        else:
            out.append({n: values[n][i] for n in records.names})
    return out


def same(records: JsonRecords, got, want) -> bool:
    """The decoder's row equals the reference's (a float column holds 32-bit floats)."""
    if want is None or got is None:
        return got is want
    for name, kind in records.columns:
        a, b = got[name], want[name]
        if kind == "float" and b is not None:
            b = float(np.float32(b))
            if math.isinf(b):  # beyond float32: Spark reads Infinity too
                b = math.copysign(math.inf, want[name])
        if a != b or type(a) is not type(b):
            return False
    return True


# (line, expected columns of ALL or None for corrupt): one case per rule
CASES = [
    (b'{"s": "x", "i": 7}', {"s": "x", "i": 7}),  # declared fields, the rest null
    (b'  {"s": "x"}\t ', {"s": "x"}),  # whitespace around the value
    (b'{"s": "x", "s": "y"}', {"s": "y"}),  # a repeated name: the last
    (b'{"S": "x"}', {}),  # names are case-sensitive
    (b'{"odd-name": "ok"}', {"odd-name": "ok"}),  # not a Python name
    (b'{"s": null, "i": null}', {}),  # null is null
    (b'{"other": [1, {"deep": [true]}], "i": 1}', {"i": 1}),  # other fields ignored
    (b'{"s": 5}', None),  # a number is not a string
    (b'{"i": "5"}', None),  # a string is not an integer
    (b'{"i": 5.0}', None),  # nor a fraction
    (b'{"i": 5e0}', None),  # nor an exponent
    (b'{"i": true}', None),  # nor a boolean
    (b'{"b": 1}', None),  # 1 is not a boolean
    (b'{"t": 127, "h": -32768}', {"t": 127, "h": -32768}),  # the ranges' ends
    (b'{"t": 128}', None),  # past tinyint
    (b'{"i": 2147483648}', None),  # past int
    (b'{"l": 9223372036854775808}', None),  # past bigint
    (b'{"d": 5}', {"d": 5.0}),  # an integer is a double
    (b'{"d": 1e400}', None),  # past a double's range
    (b'{"d": NaN}', None),  # NaN is not JSON
    (b'[{"s": "x"}]', None),  # not an object
    (b'"text"', None),  # not an object
    (b'', None),  # an empty line
    (b'{"s": "x"} {"s": "y"}', None),  # two values
    (b'{"s": "x",}', None),  # a trailing comma
    (b'{"s": "\\ud800"}', None),  # a lone surrogate escape
    (b'{"s": "\\ud83d\\ude00"}', {"s": "\U0001F600"}),  # a surrogate pair
    (b'{"s": "a\\u0000b"}', {"s": "a\x00b"}),  # an escaped NUL is a character
    (b'{"s": "\xff"}', None),  # not UTF-8
    (b'\xef\xbb\xbf{"s": "x"}', None),  # a byte-order mark
    (b'{"s": "tab\there"}', None),  # a raw control character in a string
]


@pytest.mark.parametrize(("line", "want"), CASES, ids=[c[0].decode("utf-8", "replace")[:30]
                                                       for c in CASES])
def test_each_rule(line, want):
    expected = None if want is None else {n: want.get(n) for n in NAMES}
    assert same(ALL, decoded(ALL, [line])[0], expected)
    assert same(ALL, reference_decode(ALL, line), expected)


def test_too_large_and_nul_lines_are_the_spouts_refusals():
    records = JsonRecords("s string")
    got = decoded(records, [b'{"s": "' + b"x" * 100 + b'"}', b'{"s": "a\x00b"}',
                            b'{"s": "fine"}', b"not json"], max_bytes=64)
    assert got[0] == "oversized record (109 bytes, over max_record_bytes=64)"
    assert got[1] == NUL
    assert got[2] == {"s": "fine"} and got[3] is None


def test_deep_nesting_is_corrupt_not_a_crash():
    deep = b'{"s": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert decoded(ALL, [deep, b'{"s": "after"}']) == [None, {**dict.fromkeys(NAMES),
                                                              "s": "after"}]


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from([2 ** 63 - 1, -(2 ** 63), 2 ** 31, 127, -129, 1e308, 3.4e39]))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from([*NAMES, "x", "S"]), inner, max_size=4)), max_leaves=12)


def _json(doc) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode("utf-8")


@st.composite
def lines(draw) -> bytes:
    """A JSON document (usually an object with the declared names), sometimes mangled: cut,
    spliced with odd bytes, a field's text replaced by raw text."""
    line = _json(draw(documents))
    how = draw(st.integers(0, 9))
    if how == 0 and len(line) > 1:
        line = line[:draw(st.integers(0, len(line) - 1))]
    elif how == 1:
        at = draw(st.integers(0, len(line)))
        junk = draw(st.sampled_from([b",", b"}", b"\xff", b"\x00", b" ", b"NaN", b"1e999",
                                     b'"\\ud800"', b"\t", b"\n"]))
        line = line[:at] + junk + line[at:]
    elif how == 2:
        name = draw(st.sampled_from(NAMES))
        raw = draw(st.sampled_from([b"1.0", b"-0", b"1E2", b"00", b"true", b'"\\u0041"',
                                    b"[]", b"{}", b"-9223372036854775809", b"2e-400"]))
        line = b'{"' + name.encode() + b'": ' + raw + b"}"
    return line


@settings(max_examples=400, deadline=None)
@given(st.lists(lines(), min_size=1, max_size=30))
def test_the_decoder_keeps_the_reference_rules(batch):
    got = decoded(ALL, batch)
    for line, row in zip(batch, got, strict=True):
        want = reference_decode(ALL, line)
        if b"\x00" in line:  # never JSON; and the spout refuses such a payload
            assert want is None and row == NUL, line
        else:
            assert same(ALL, row, want), line


@pytest.mark.parametrize(("ddl", "says"), [
    ("ts timestamp", "column 'ts' is timestamp"),
    ("m map<string,int>", "column 'm' is map<string,int>"),
    ("_corrupt_record string", "a name onceflow gives the record itself"),
    ("payload string", "a name onceflow gives the record itself"),
    ("url", "has no type"),
    ("  ", "give the records' fields"),
])
def test_schemas_it_cannot_decode_are_refused_by_name(ddl, says):
    with pytest.raises(ConfigError, match="source.json_schema") as error:
        JsonRecords(ddl)
    assert says in str(error.value)


def test_a_json_schema_needs_json_lines(tmp_path):
    with pytest.raises(ConfigError, match="format='jsonl'"):
        LandingFolder(topic="t", path=str(tmp_path), format="csv",
                      json_schema="s string").validate()
    with pytest.raises(ConfigError, match="column 'ts' is timestamp"):
        LandingFolder(topic="t", path=str(tmp_path), json_schema="ts timestamp").validate()
    source = LandingFolder(topic="t", path=str(tmp_path), json_schema="s string, n long")
    source.validate()
    assert source.read_ddl == ("partition int, offset long, `s` string, `n` bigint, "
                               "_corrupt_record string, _problem string")


def test_invalid_utf8_in_a_skipped_field_makes_the_line_corrupt():
    # msgspec does not look inside a field the schema skips; Spark's reader refuses the line
    line = b'{"s": "a", "x": {"y": "\xff"}}'
    assert reference_decode(JsonRecords("s string"), line) is None
    columns, problems = JsonRecords("s string").decode([line, b'{"s": "b"}'])
    assert columns["s"].to_pylist() == [None, "b"]
    assert columns[CORRUPT].to_pylist() == [line.decode("utf-8", "replace"), None]
    assert problems.to_pylist() == [None, None]
