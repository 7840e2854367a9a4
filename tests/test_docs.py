"""The docs stay true: every link in README.md, docs/ and bench/ resolves (files and headings),
every Python block in them runs (a declaration imports and validates; the guide's pipeline,
written from its own blocks into a package, runs its transactions through the README's
library call and counts what an oracle of this test counts), and every command in the
README's table answers ``--help``."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

import onceflow
from onceflow.cli import main
from onceflow.core.db import connection
from onceflow.core.pipeline import Pipeline
from onceflow.core.registration import register

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "bench").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _blocks(doc: Path) -> list[str]:
    return BLOCK.findall(doc.read_text())


def _block(doc: Path, marker: str) -> str:
    found = [b for b in _blocks(doc) if marker in b]
    assert len(found) == 1, f"{doc.name}: one Python block with {marker!r}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, mailto: ...: not checked offline
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target}: no heading #{anchor} in {where.name}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def _namespace() -> dict:
    """What a doc's block may take as already imported: onceflow's public names."""
    return {name: getattr(onceflow, name) for name in onceflow.__all__}


DECLARATIONS = [(doc, i) for doc in DOCS for i, block in enumerate(_blocks(doc))
                if "run_batches(" not in block and "transaction_dag(" not in block
                and "def build(" not in block]


@pytest.mark.parametrize("doc,index", DECLARATIONS,
                         ids=[f"{d.relative_to(ROOT)}[{i}]" for d, i in DECLARATIONS])
def test_each_declaration_block_runs_and_validates(doc, index):
    namespace = _namespace()
    exec(compile(_blocks(doc)[index], f"{doc.name}[{index}]", "exec"), namespace)
    for value in namespace.values():
        if isinstance(value, Pipeline):
            value.validate()


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| command | does |"):]
    table = table[:table.index("\n\n")]
    commands = []
    for cell in re.findall(r"^\| `([^`]+)`", table, re.M):
        commands.append(cell.split()[0].split("|")[0])
    for alternative in re.findall(r"^\| `[^`]+` / `([^`]+)`", table, re.M):
        commands.append(alternative.split()[0])
    return commands


@pytest.mark.parametrize("command", _readme_commands())
def test_each_command_in_the_readme_answers_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert command in capsys.readouterr().out


def test_the_readme_command_table_is_read():
    # the table is found and holds every row; a change of its shape fails here, not silently
    assert {"init", "status", "verify", "produce", "import", "spark", "pg"} <= set(
        _readme_commands())


def test_the_guides_pipeline_runs_from_its_own_blocks(tmp_path, monkeypatch, spark, dsn):
    """The guide's declaration and topology, written into a package as the guide says, run
    through the README's library call; the DAG file of the guide builds its DAG."""
    guide = ROOT / "docs" / "write-your-own-pipeline.md"
    package = tmp_path / "pageviews"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipelines.py").write_text(_block(guide, "PAGE_VIEWS = Pipeline("))
    (package / "topology.py").write_text(_block(guide, "def build("))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "pageviews" or m.startswith("pageviews.")]:
        monkeypatch.delitem(sys.modules, name)
    from pageviews.pipelines import PAGE_VIEWS

    namespace: dict = {}
    exec(compile(_block(guide, "transaction_dag("), "the guide's DAG file", "exec"), namespace)
    assert namespace["dag"].dag_id == f"onceflow_{PAGE_VIEWS.name}"
    assert {t.task_id for t in namespace["dag"].tasks} >= {"begin", "process", "commit"}

    countries = ["de", "fr", "nl", "de"]
    records = [json.dumps({"country": countries[i % 4], "page": f"/p{i % 3}"})
               for i in range(40)] + ['{"country": ']  # one malformed: rejected
    expected_countries = Counter(c.upper() for c in (countries * 10))
    expected_pages = Counter(f"/p{i % 3}" for i in range(40))

    with connection(dsn) as conn:
        register(conn, PAGE_VIEWS, create_source=True)
        PAGE_VIEWS.source.append(conn, records)
    namespace = {"spark": spark, "dsn": dsn, "pipeline": PAGE_VIEWS}
    exec(compile(_block(ROOT / "README.md", "run_batches("), "README's library call", "exec"),
         namespace)
    assert namespace["done"].committed, "the README's call committed nothing"
    with connection(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT key, value FROM views_per_country")
        assert Counter(dict(cur.fetchall())) == expected_countries
        cur.execute("SELECT key, value FROM views_per_page")
        assert Counter(dict(cur.fetchall())) == expected_pages
