"""Run the commands of the README and of every docs page in order on a fresh clone, as written;
report each with its file and line (slow and opt-in: the default sweep alone takes minutes on
two cores, and each ``vpipe ab`` session up to its time budget).

    python -m bench.readme_commands [--repo .] [--keep] [--dry-run] [--page PATH]...

Pages: ``README.md``, then ``docs/index.md``, then the docs pages in the order the index links
them, then any other ``docs/*.md`` page in sorted order. ``--page`` runs only the pages named
(commands that read what an earlier page wrote then fail).

Commands are the lines of the pages' fenced blocks that start with ``vpipe`` or
``PYTHONPATH=... vpipe`` (a line ending in ``\\`` continues on the next), plus the inline
``vpipe run ...`` commands in backticks that name a built-in schedule, and the Python blocks
that begin with ``import vpipe``. Optional parts in ``[...]`` are run (they produce files later
commands read, such as ``zbv.csv``); ``RUN`` is a vpipe run id of the store the command reads.
A fenced line starting with ``$ vpipe`` is a transcript, shown with its output: it is listed,
not run. Left out, and said so: ``make`` (it installs), ``torchrun`` (GPUs, several nodes;
its ``-m vpipe`` commands are listed), ``asv`` (it builds environments), ``tensorboard``, and
commands with ``--device cuda`` on a machine without CUDA. The clone is made from the
repository's HEAD commit (``git clone``), so uncommitted changes are not tried. ``tests/test_doc_commands.py`` parses every command this
module finds with vpipe's own argument parser, without running it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SKIPPED_TOOLS = ("make", "torchrun", "asv", "tensorboard", "source")
# A vpipe command line, perhaps after a "$ " prompt; not a message such as "vpipe plan: error".
_SHELL_LINE = re.compile(r"^(\$ )?((PYTHONPATH=\S+ )?vpipe\s(?![\w-]+:).*)$")
_INLINE_RUN = re.compile(r"`(vpipe run [a-z][^`]*)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Command:
    """One command of a page: ``kind`` is ``sh``, ``python`` or ``torchrun`` (a vpipe command
    under torchrun: listed, not run); ``line`` is 1-based."""

    kind: str
    text: str
    file: str
    line: int
    transcript: bool = False  # a ``$ vpipe ...`` line shown with its output: listed, not run

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def split_env(self) -> tuple[dict[str, str], list[str]]:
        """The leading ``KEY=value`` assignments of a shell command, and its words from
        ``vpipe`` on (optional parts included)."""
        words = shlex.split(as_written(self.text))
        env: dict[str, str] = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        return env, words

    def vpipe_words(self) -> list[str]:
        """The words of the ``vpipe`` command itself (after ``vpipe``, or after torchrun's
        ``-m vpipe``), optional parts included, environment assignments dropped."""
        if self.kind == "torchrun":
            words = shlex.split(as_written(self.text))
            return words[words.index("-m") + 2 :]
        return self.split_env()[1][1:]

    def shown(self) -> str:
        if self.kind == "python":
            return self.text.splitlines()[0] + " ..."
        return as_written(self.text)


def page_commands(text: str, file: str = "README.md") -> list[Command]:
    """The commands of one markdown page, in page order."""
    out: list[Command] = []
    lines = text.splitlines()
    i = 0
    prose: list[tuple[int, str]] = []

    def flush_prose() -> None:
        if not prose:
            return
        start = prose[0][0]
        joined = " ".join(s for _, s in prose)  # one space per newline: offsets map to lines
        for m in _INLINE_RUN.finditer(joined):
            line = start + _newlines_before(prose, m.start())
            out.append(Command("sh", m.group(1), file, line))
        prose.clear()

    while i < len(lines):
        if not lines[i].startswith("```"):
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        flush_prose()
        lang, start = lines[i][3:].strip(), i + 1
        i += 1
        body: list[tuple[int, str]] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1  # the closing fence
        if lang == "python":
            code = "\n".join(s for _, s in body)
            if code.lstrip().startswith("import vpipe"):
                out.append(Command("python", code, file, start + 1))
            continue
        j = 0
        while j < len(body):
            n, cmd = body[j]
            while cmd.rstrip().endswith("\\") and j + 1 < len(body):
                j += 1
                cmd = cmd.rstrip()[:-1].rstrip() + " " + body[j][1].strip()
            j += 1
            cmd = cmd.split("  #", 1)[0].strip()
            m = _SHELL_LINE.match(cmd)
            if m:
                out.append(Command("sh", m.group(2), file, n, transcript=bool(m.group(1))))
            elif cmd.startswith("torchrun ") and " -m vpipe " in cmd:
                out.append(Command("torchrun", cmd, file, n))
    flush_prose()
    return out


def _newlines_before(prose: list[tuple[int, str]], offset: int) -> int:
    """How many of the joined prose lines end before ``offset`` of their joined text."""
    end = 0
    for k, (_, s) in enumerate(prose):
        end += len(s) + 1
        if offset < end:
            return k
    return len(prose) - 1


def doc_pages(repo: Path) -> list[Path]:
    """README.md, docs/index.md, the pages the index links in its order, then the rest sorted."""
    pages = [repo / "README.md"]
    docs = repo / "docs"
    index = docs / "index.md"
    if index.exists():
        pages.append(index)
        for target in _LINK.findall(index.read_text(encoding="utf-8")):
            path = (docs / target.split("#", 1)[0]).resolve()
            if path.suffix == ".md" and path.parent == docs.resolve() and path not in pages:
                pages.append(path)
    pages += sorted(p.resolve() for p in docs.glob("*.md") if p.resolve() not in pages)
    return [p for p in pages if p.exists()]


def collect(repo: Path, only: list[str] | None = None) -> list[Command]:
    """Every command of the README and the docs pages, in page order."""
    repo = repo.resolve()
    out: list[Command] = []
    for page in doc_pages(repo):
        rel = page.resolve().relative_to(repo).as_posix()
        if only and rel not in only:
            continue
        out += page_commands(page.read_text(encoding="utf-8"), rel)
    return out


def as_written(cmd: str) -> str:
    """The command with its optional ``[...]`` parts included."""
    return re.sub(r"\s+", " ", re.sub(r"\[([^\]]*)\]", r"\1", cmd)).strip()


def needs_gpu(cmd: str) -> bool:
    return "--device cuda" in cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=".", help="the repository to clone (default .)")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    ap.add_argument("--dry-run", action="store_true", help="list the commands, run nothing")
    ap.add_argument(
        "--page",
        action="append",
        metavar="PATH",
        help="only this page (e.g. docs/commands.md); repeat for several",
    )
    args = ap.parse_args(argv)
    repo = Path(args.repo).resolve()
    commands = collect(repo, args.page)
    if args.dry_run:
        for c in commands:
            note = "  (transcript: not run)" if c.transcript else ""
            print(f"{c.where}: {c.kind}: {c.shown()}{note}")
        pages = [p.relative_to(repo).as_posix() for p in doc_pages(repo)]
        pages = [p for p in pages if not args.page or p in args.page]
        print(f"{len(commands)} commands from {len(pages)} page(s): {', '.join(pages)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="vpipe-readme-"))
    clone = work / "vpipe"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    print(f"fresh clone of {head[:12]} in {clone}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    failed = ran = 0
    gpu = _has_cuda()
    for n, c in enumerate(commands, 1):
        if c.transcript or c.kind == "torchrun":
            why = "a transcript: shown, not run" if c.transcript else "torchrun: not run here"
            print(f"[{n:3}] skip          {c.where}  {c.shown()}  ({why})")
            continue
        if needs_gpu(c.text) and not gpu:
            print(f"[{n:3}] skip          {c.where}  {c.shown()}  (needs a CUDA device)")
            continue
        if c.kind == "python":
            argv_, shown, extra = [sys.executable, "-c", c.text], "python: " + c.shown(), ""
        else:
            assigned, words = c.split_env()
            extra = assigned.get("PYTHONPATH", "")
            if "RUN" in words:
                words[words.index("RUN")] = _a_run_id(clone, words, env)
            shown = " ".join(words)
            argv_ = [sys.executable, "-m", "vpipe", *words[1:]]
        run_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [extra, str(clone)]))}
        t0 = time.perf_counter()
        r = subprocess.run(argv_, cwd=clone, env=run_env, capture_output=True, text=True)
        took = time.perf_counter() - t0
        ran += 1
        status = "ok  " if r.returncode == 0 else f"FAIL {r.returncode}"
        print(f"[{n:3}] {status} {took:6.1f} s  {c.where}  {shown}", flush=True)
        if r.returncode != 0:
            failed += 1
            print("      " + "\n      ".join((r.stderr or r.stdout).strip().splitlines()[-5:]))
    print(f"left out (not runnable here as written): {', '.join(SKIPPED_TOOLS)} commands")
    print(f"{ran - failed} of {ran} commands run worked ({len(commands)} found)")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 1 if failed else 0


def _has_cuda() -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() == "True"


def _a_run_id(clone: Path, words: list[str], env: dict) -> str:
    """A measured vpipe run id of the store the command names (zbv if there is one)."""
    store = words[words.index("--from") + 1] if "--from" in words else words[2]
    code = (
        "import sys; from vpipe.trace.store import Store; r = Store(sys.argv[1]).runs(); "
        "r = r[(r['impl'] == 'vpipe') & (r['source'] == 'measured')]; "
        "z = r[r['schedule'] == 'zbv']; print((z if len(z) else r)['run_id'].iloc[0])"
    )
    out = subprocess.run([sys.executable, "-c", code, store], cwd=clone, capture_output=True,
                         text=True, env={**env, "PYTHONPATH": str(clone)})  # fmt: skip
    return out.stdout.strip() or "RUN"


if __name__ == "__main__":
    raise SystemExit(main())
