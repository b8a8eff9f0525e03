"""Every command output the README and the docs quote is what the command prints now, or a
dated example of the right shape (``bench.doc_outputs``); doc commands write under out/ or
results/, never into the checkout's top; the pages speak of the project only."""

from __future__ import annotations

import re
from pathlib import Path

from bench.doc_outputs import check, quoted
from bench.readme_commands import collect, doc_pages

REPO = Path(__file__).resolve().parents[1]
PAGES = doc_pages(REPO)


def test_every_quoted_output_is_what_its_command_prints_or_a_dated_example():
    assert check(PAGES) == []
    kinds = {q.kind for page in PAGES for q in quoted(page)}
    assert kinds == {"output", "example"}  # both are in use: neither check is vacuous


def test_a_stale_output_an_unmarked_one_and_a_misshapen_example_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- output: vpipe show zbv -p 2 -m 2 -->\n```text\nan old grid\n```\n\n"
        "```\nM=8 vpipe: run zbv: 1.05x faster than 1f1b\n```\n\n"
        "<!-- example: 2026-12-07, a 2-core host: vpipe bench --quick -->\n```text\n"
        "M=4 vpipe: run zbv: 1.05x faster than 1f1b, the next fastest (95% CI 1.01-1.07)\n```\n"
    )
    problems = check([page])
    assert problems == [
        "page.md:1: `vpipe show zbv -p 2 -m 2` prints something else now",
        "page.md:10: not the shape of `vpipe bench` output: 'M=4 vpipe: run zbv: 1.05x faster "
        "than 1f1b, the next fastest'",
        "page.md:6: output without a marker: 'M=8 vpipe: run zbv: 1.05x faster than 1f1b'",
    ]
    check([page], update=True)
    assert "an old grid" not in page.read_text() and "1F0" in page.read_text()
    left = [p.split(": ", 1)[1] for p in check([page])]  # the grid is current now
    assert left[0].startswith("not the shape of `vpipe bench` output") and len(left) == 2


def test_doc_commands_write_under_out_or_results():
    outputs = ("-o", "--output", "--out", "--csv", "--plot", "--traces")
    wrong = []
    for c in collect(REPO):
        if c.kind == "python":
            continue
        words = c.vpipe_words()
        for i, word in enumerate(words):
            flag, _, value = word.partition("=")
            value = value or (words[i + 1] if i + 1 < len(words) else "")
            if flag in outputs and not value.startswith(("out/", "results/", "$")):
                wrong.append(f"{c.where}: {flag} {value}")
    assert wrong == []


def test_the_pages_speak_of_the_project_only():
    said = [f"{p.name}: {m[0]}" for p in PAGES
            for m in re.finditer(r"(?i)\b(the issue|issue #?\d+|issues?'s?)\b.{0,30}", p.read_text())]  # fmt: skip
    assert said == []


def test_the_glossary_is_the_one_the_docs_show():
    from vpipe.report.glossary import GLOSSARY

    page = (REPO / "docs" / "results.md").read_text()
    assert [w for w, means in GLOSSARY.items() if f"| {w} | {means} |" not in page] == []
