"""The README and the docs pages say nothing vpipe would refuse to parse, and link nothing that
is not there.

Every ``vpipe ...`` command that ``bench.readme_commands`` finds (fenced blocks, inline
``vpipe run ...``, torchrun's ``-m vpipe ...``) is parsed by vpipe's own argument parser, with
and without its optional ``[...]`` parts, without running it; schedule names must be in the
catalogue. Inline ``vpipe <command> --flag`` spans in prose must name a real command and real
flags. Every relative link must point to a file that exists (and a heading, for ``#anchor``s
into markdown pages). No torch is imported: the parser and the catalogue need none.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from bench.readme_commands import Command, as_written, collect, doc_pages
from vpipe.cli import build_parser
from vpipe.commands.ab import own_options
from vpipe.schedules import catalogue

REPO = Path(__file__).resolve().parents[1]
COMMANDS = collect(REPO)
SHELL = [c for c in COMMANDS if c.kind in ("sh", "torchrun")]
PYTHON = [c for c in COMMANDS if c.kind == "python"]
PAGES = doc_pages(REPO)
STUBS = {"RUN": "stub-run-id"}  # placeholders the docs use for values only a run gives


def _rel(page: Path) -> str:
    return page.resolve().relative_to(REPO).as_posix()


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse as ``vpipe`` would; a refusal fails with argparse's own line."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --version, --help
            return argparse.Namespace(command=None)
        raise AssertionError(f"vpipe {' '.join(argv)}: {err.getvalue().strip()}") from None


def _check_names(ns: argparse.Namespace) -> None:
    names = []
    if ns.command in ("show", "simulate", "run"):
        names.append(getattr(ns, "source", None) or ns.schedule)
    if ns.command == "analyze" and getattr(ns, "predict", None):
        names += list(ns.predict)
    if isinstance(getattr(ns, "schedules", None), str):
        names += [n for n in ns.schedules.split(",") if n]
    for name in names:
        if not name.endswith(".csv"):
            catalogue.get(name)  # raises on a name the catalogue does not know


def check_command(words: list[str]) -> None:
    """``words`` (after ``vpipe``) parse, and ``vpipe ab``'s sweep options parse as bench's."""
    parser = build_parser()
    words = [STUBS.get(w, w) for w in words]
    ns = _parse(parser, words)
    _check_names(ns)
    if ns.command == "ab":
        mine, bench = own_options().parse_known_args(ns.bench)
        assert mine.out, "vpipe ab needs --out"
        _check_names(_parse(parser, ["bench", *bench, "--out", mine.out]))


@pytest.mark.parametrize("cmd", SHELL, ids=[c.where for c in SHELL])
def test_command_parses(cmd: Command) -> None:
    check_command(cmd.vpipe_words())
    bare = re.sub(r"\s*\[[^\]]*\]", "", cmd.text)  # the optional parts left out
    if bare != cmd.text:
        check_command(Command(cmd.kind, bare, cmd.file, cmd.line).vpipe_words())


@pytest.mark.parametrize("cmd", PYTHON, ids=[c.where for c in PYTHON])
def test_python_block_compiles(cmd: Command) -> None:
    compile(cmd.text, cmd.where, "exec")


def test_the_check_itself_fails_on_stale_commands() -> None:
    for words in (["shwo", "zbv"], ["show", "zbv", "--no-such-flag"], ["show", "no-such-family"],
                  ["ab", "A", "B", "--out", "o", "--no-such-bench-flag"]):  # fmt: skip
        with pytest.raises(Exception):  # noqa: B017 (an AssertionError or a ScheduleError)
            check_command(words)


def test_every_page_is_read() -> None:
    """The extractor reads the README and every docs page; the index links every page."""
    docs = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [_rel(p) for p in PAGES][0] == "README.md"
    assert sorted(p.name for p in PAGES[1:]) == docs
    index = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    linked = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", index)}
    assert set(docs) - {"index.md"} <= linked, "docs/index.md must link every page"
    assert {c.file for c in SHELL} >= {"README.md"}
    assert any(c.file.startswith("docs/") for c in SHELL)


def test_readme_is_short() -> None:
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n < 200, f"README.md has {n} lines: move detail into docs/"


def test_outputs_do_not_collide() -> None:
    """Run in order, no two commands write the same --out directory without --force/--append
    (vpipe bench refuses a non-empty one)."""
    seen: dict[str, str] = {}
    for c in SHELL:
        words = c.vpipe_words()
        if not words or words[0] not in ("bench", "ab") or "--out" not in words:
            continue
        if c.transcript or c.kind == "torchrun" or {"--force", "--append"} & set(words):
            continue
        out = words[words.index("--out") + 1]
        assert out not in seen, f"{c.where}: --out {out} already written by {seen[out]}"
        seen[out] = c.where


# -- inline spans in prose -------------------------------------------------------------------


def _prose(text: str) -> str:
    """The page without its fenced blocks (their lines blanked, so line numbers hold)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _inline_spans() -> list[tuple[str, str]]:
    spans = []
    for page in PAGES:
        prose = _prose(page.read_text(encoding="utf-8"))
        for m in re.finditer(r"`(vpipe [^`]+)`", prose):
            line = prose.count("\n", 0, m.start()) + 1
            spans.append((f"{_rel(page)}:{line}", m.group(1)))
    return spans


SPANS = _inline_spans()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("where,span", SPANS, ids=[w for w, _ in SPANS])
def test_inline_flags_exist(where: str, span: str) -> None:
    parser = build_parser()
    sub = _subcommands(parser)
    try:
        words = shlex.split(as_written(span))
    except ValueError:
        words = as_written(span).split()
    command = words[1]
    if command.endswith(":") or not re.fullmatch(r"-{0,2}[a-z][a-z-]*", command):
        return  # a message quoted from vpipe's output, not a command
    if command.startswith("-"):
        assert command in _flags(parser), f"{where}: `{span}`: vpipe has no {command}"
        return
    assert command in sub, f"{where}: `{span}`: vpipe has no command {command!r}"
    known = _flags(sub[command])
    if command == "ab":
        known |= _flags(own_options()) | _flags(sub["bench"])
    for w in words[2:]:
        flag = w.split("=", 1)[0]
        if flag.startswith("--") and flag != "--":
            assert flag in known, f"{where}: `{span}`: vpipe {command} has no {flag}"


# -- links -----------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    prose = _prose(page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose, flags=re.M)}


def _links() -> list[tuple[str, Path, str]]:
    out = []
    for page in PAGES:
        prose = _prose(page.read_text(encoding="utf-8"))
        for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            line = prose.count("\n", 0, m.start()) + 1
            out.append((f"{_rel(page)}:{line}", page, target))
    return out


LINKS = _links()


@pytest.mark.parametrize("where,page,target", LINKS, ids=[f"{w} {t}" for w, _, t in LINKS])
def test_relative_link_exists(where: str, page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{where}: link to {target}: no such file"
    assert REPO in dest.parents or dest == REPO, f"{where}: {target} points outside the repository"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{where}: {target}: no heading with that anchor"


# -- docs/commands.md: a section per command, and its option tables --------------------------


def _command_sections() -> list[tuple[str, list[str], str]]:
    """``(heading, commands it names, body)`` for each ``##`` section of docs/commands.md."""
    text = _prose((REPO / "docs" / "commands.md").read_text(encoding="utf-8"))
    out = []
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        out.append((heading, re.findall(r"`vpipe ([a-z]+)", heading), body))
    return out


def test_every_command_has_a_section() -> None:
    sub = _subcommands(build_parser())
    documented = {c for _, commands, _ in _command_sections() for c in commands}
    assert set(sub) <= documented, f"no section for {set(sub) - documented}"


def test_option_tables_name_real_flags() -> None:
    """In docs/commands.md, every flag an option table lists belongs to a command its section
    (or the row's own `commands` column) names."""
    sub = _subcommands(build_parser())
    checked = 0
    for heading, commands, body in _command_sections():
        for row in body.splitlines():
            cells = (
                [c.strip() for c in row.strip().strip("|").split("|")]
                if row.startswith("|")
                else []
            )
            if not cells or not cells[0].startswith("`-"):
                continue
            names = commands
            if len(cells) > 2 and re.fullmatch(r"[a-z, ]+", cells[1]):  # a `commands` column
                names = [c.strip() for c in cells[1].split(",")]
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", cells[0]):
                owners = [c for c in names if flag in _flags(sub[c])]
                assert owners, f"docs/commands.md ({heading}): {flag} is not an option of {names}"
                checked += 1
    assert checked > 50
