"""The command outputs that the README and the docs pages quote, checked against what the
commands print now, or regenerated.

    python -m bench.doc_outputs [--update [--examples [--host WORDS]]] [--page PATH]...

A quoted output is a fenced ``text`` block right under a marker line naming what produced it:

- ``<!-- output: vpipe show zbv -p 2 -m 4 -->``: the command's output (stdout and stderr, as
  printed), reproducible here in seconds. The check runs the command (in this process, with
  vpipe's own ``main``) and reports every block that differs; ``--update`` writes the output
  in instead.
- ``<!-- example: 2026-12-04, a shared 2-core AMD EPYC CPU host: vpipe bench ... -->``: an
  output of a command too slow, or too host-bound, to reproduce: dated and placed. It is not
  run; its command must parse, and its lines must have the shape of that command's output
  where :data:`SHAPES` knows it (each line matches one of the command's patterns).
  ``--update --examples`` runs them too and writes in their output, today's date and the host
  (``--host``, default: this machine's core count and CPU model).

``tests/test_doc_outputs.py`` runs the check, and fails on any other fenced block that is not
commands (a block without a language whose lines are not command lines: output quoted with
no marker).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from bench.readme_commands import doc_pages

MARKER = re.compile(r"^<!-- (output|example): (.*) -->$")
EXAMPLE = re.compile(r"^(\d{4}-\d{2}-\d{2}), ([^:]+): (vpipe .*)$")
# The line shapes of slow commands' outputs (examples are checked against these): a verdict
# line, or a line of the summary table as printed on the terminal
SHAPES: dict[str, list[str]] = {
    "bench": [
        r"^M=\d+ \w+: run \S+: (\d+\.\d+x faster than \S+, the next fastest by median step time"
        r" \(paired ratio, 95% CI \d+\.\d+-\d+\.\d+\); every other schedule is slower"
        r"|a tie of .*picked by the tie rule: .*)$",
    ],
}
SHAPES["plan"] = [
    r"^\S+ \(seq \d+\) on \d+ \S+ GPUs, global batch \d+ sequences, .*; budget [\d.]+ GiB per GPU$",
    r"^rates \(recommended layout\): ",
    r"^schedule +v +tp +cp +pp +dp +recomp\. +mb +M +tok/s/GPU +MFU +HFU +iter s +GiB/GPU +w\+g\+o +activ\. +buf\. +tie$",
    r"^[\w-]+ +(\d+ +){5}(none|selective|full) +\d+ +\d+ +[\d.]+ +[\d.]+% +[\d.]+% +([\d.]+ +){4}[\d.]+ *(yes)? *$",
    r"^\(\d+ of \d+ candidates that fit shown; ",
    r"^recommended \(of the tied, the least memory\): ",
    r"^  (layers per stage|memory per GPU|share of the step): ",
]
COMMAND_LINE = re.compile(r"^(\$ |#|\s|(PYTHONPATH=\S+ )?(vpipe|python|make|torchrun|asv|source|pip|git|cd|tensorboard)\b)")


@dataclass
class Quoted:
    """One quoted output: its page, the line of its marker, ``output`` or ``example``, what
    the marker says (the command; for an example its date and host too) and the block's
    text."""

    page: Path
    line: int
    kind: str
    command: str
    body: str
    date: str = ""
    host: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


def quoted(page: Path) -> list[Quoted]:
    """The marked blocks of one page, in page order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        if i + 1 >= len(lines) or lines[i + 1] != "```text":
            raise SystemExit(f"{page}:{i + 1}: a marker must be followed by a ```text block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j] == "```")
        q = Quoted(page, i + 1, m[1], m[2], "\n".join(lines[i + 2 : end]))
        if q.kind == "example":
            e = EXAMPLE.match(m[2])
            if not e:
                raise SystemExit(f"{q.where}: an example marker is 'example: YYYY-MM-DD, HOST: vpipe ...'")
            q.date, q.host, q.command = e[1], e[2], e[3]
        out.append(q)
    return out


def unmarked(page: Path) -> list[str]:
    """Fenced blocks without a language that hold something other than command lines and
    have no marker: output quoted without saying where it came from."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        body = lines[i + 1 : end]
        marked = start > 0 and MARKER.match(lines[start - 1])
        after_continuation = [b for k, b in enumerate(body) if k and body[k - 1].rstrip().endswith("\\")]
        odd = [b for b in body if b.strip() and not COMMAND_LINE.match(b) and b not in after_continuation]
        if not lang and not marked and odd:
            found.append(f"{page.name}:{start + 1}: output without a marker: {odd[0][:60]!r}")
        i = end + 1
    return found


def run(command: str) -> str:
    """What ``command`` (a ``vpipe ...`` line) prints, stdout and stderr as they interleave,
    run in this process."""
    from vpipe.cli import main

    words = shlex.split(command)
    if words[0] != "vpipe":
        raise SystemExit(f"not a vpipe command: {command}")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            main(words[1:])
        except SystemExit:
            pass  # argparse's errors: their message is what the docs quote
    return buffer.getvalue().rstrip("\n")


def shape_errors(q: Quoted) -> list[str]:
    """The lines of an example that do not have its command's shape (:data:`SHAPES`)."""
    from bench.readme_commands import Command
    from vpipe.cli import build_parser

    words = Command("sh", q.command, q.page.name, q.line).vpipe_words()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(words)
    except SystemExit:
        return [f"{q.where}: its command does not parse: {q.command}"]
    if not q.body.strip():
        return [f"{q.where}: an empty example"]
    patterns = SHAPES.get(words[0], [])
    return [
        f"{q.where}: not the shape of `vpipe {words[0]}` output: {line[:60]!r}"
        for line in q.body.splitlines()
        if patterns and line.strip() and not any(re.match(p, line) for p in patterns)
    ]


def this_host() -> str:
    """This machine in words: its core count and CPU model."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = " " + line.split(":", 1)[1].strip()
                break
    return f"a {os.cpu_count()}-core{model} host"


def _block(q: Quoted, body: str, host: str = "") -> str:
    head = f"example: {date.today().isoformat()}, {host}: {q.command}" if host else f"output: {q.command}"
    return f"<!-- {head} -->\n```text\n{body}\n```"


def check(pages: list[Path], update: bool = False, examples: str = "") -> list[str]:
    """Every difference between a quoted output and its command's, every example of the wrong
    shape, and every unmarked output (empty: all agree); with ``update``, outputs are
    rewritten instead of reported, and with ``examples`` (the host, in words) examples too."""
    problems = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for q in quoted(page):
            old = "\n".join(page.read_text(encoding="utf-8").splitlines()[q.line - 1 : q.line + 1])
            old = f"{old}\n{q.body}\n```" if q.body else f"{old}\n```"
            if q.kind == "example":
                if update and examples:
                    text = text.replace(old, _block(q, run(q.command), examples), 1)
                else:
                    problems += shape_errors(q)
                continue
            now = run(q.command)
            if now == q.body:
                continue
            if update:
                text = text.replace(old, _block(q, now), 1)
            else:
                problems.append(f"{q.where}: `{q.command}` prints something else now")
        if update:
            page.write_text(text, encoding="utf-8")
        problems += unmarked(page)
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.doc_outputs", description=__doc__.split("\n\n")[0])
    p.add_argument("--update", action="store_true", help="write the commands' outputs in")
    p.add_argument("--examples", action="store_true", help="with --update: examples too")
    p.add_argument("--host", default=None, help="the host examples name (default: this one)")
    p.add_argument("--page", action="append", default=None, help="only these pages")
    args = p.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    pages = [Path(x) for x in args.page] if args.page else doc_pages(repo)
    host = (args.host or this_host()) if args.examples else ""
    problems = check(pages, args.update, host)
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s) in {len(pages)} page(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
