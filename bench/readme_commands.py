"""Run the README's commands in order on a fresh clone, as written; report each and stop at the
first failure (slow and opt-in: the default sweep alone takes minutes on two cores).

    python -m bench.readme_commands [--repo .] [--keep] [--dry-run]

Commands are the lines of the README's fenced blocks that start with ``vpipe`` or
``PYTHONPATH=... vpipe``, plus the inline ``vpipe run ...`` commands in backticks that name a
built-in schedule, and the Python blocks that begin with ``import vpipe``. Optional parts in
``[...]`` are run (they produce files later commands read, such as ``zbv.csv``); ``RUN`` is a
vpipe run id of the store the command reads. Left out, and said so: ``make`` (it installs),
``torchrun`` (GPUs, several nodes), ``asv`` (it builds environments), ``tensorboard``.
The clone is made from the repository's HEAD commit (``git clone``), so uncommitted changes are
not tried.
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
from pathlib import Path

SKIPPED_TOOLS = ("make", "torchrun", "asv", "tensorboard", "source")


def needs_gpu(cmd: str) -> bool:
    return "--device cuda" in cmd


def readme_commands(text: str) -> list[tuple[str, str]]:
    """``(kind, command)`` in README order: kind ``sh`` or ``python``."""
    out: list[tuple[str, str]] = []
    blocks = re.split(r"^```", text, flags=re.M)
    for i, block in enumerate(blocks):
        if i % 2 == 0:  # prose between blocks: inline `vpipe run NAME ...` commands
            for m in re.finditer(r"`(vpipe run [a-z][^`]*)`", block.replace("\n", " ")):
                out.append(("sh", m.group(1)))
            continue
        lang, _, body = block.partition("\n")
        if lang.strip() == "python":
            if body.lstrip().startswith("import vpipe"):
                out.append(("python", body))
            continue
        for line in body.splitlines():
            cmd = line.split("  #", 1)[0].strip()
            if re.match(r"^(PYTHONPATH=\S+ )?vpipe\s", cmd):
                out.append(("sh", cmd))
    return out


def as_written(cmd: str) -> str:
    """The command with its optional ``[...]`` parts included."""
    return re.sub(r"\s+", " ", re.sub(r"\[([^\]]*)\]", r"\1", cmd)).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=".", help="the repository to clone (default .)")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    ap.add_argument("--dry-run", action="store_true", help="list the commands, run nothing")
    args = ap.parse_args(argv)
    repo = Path(args.repo).resolve()
    commands = readme_commands((repo / "README.md").read_text())
    if args.dry_run:
        for kind, cmd in commands:
            print(f"{kind}: {as_written(cmd) if kind == 'sh' else cmd.splitlines()[0] + ' ...'}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="vpipe-readme-"))
    clone = work / "vpipe"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    print(f"fresh clone of {head[:12]} in {clone}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    failed = 0
    gpu = _has_cuda()
    for n, (kind, cmd) in enumerate(commands, 1):
        if needs_gpu(cmd) and not gpu:
            print(f"[{n:2}] skip          {cmd}  (needs a CUDA device; this machine has none)")
            continue
        if kind == "python":
            argv_, shown = [sys.executable, "-c", cmd], "python: " + cmd.splitlines()[0] + " ..."
            extra = ""
        else:
            words = shlex.split(as_written(cmd))
            extra = ""
            while words and "=" in words[0] and not words[0].startswith("-"):
                key, _, value = words.pop(0).partition("=")
                extra = value if key == "PYTHONPATH" else extra
            if "RUN" in words:
                words[words.index("RUN")] = _a_run_id(clone, words, env)
            shown = " ".join(words)
            argv_ = [sys.executable, "-m", "vpipe", *words[1:]]
        run_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [extra, str(clone)]))}
        t0 = time.perf_counter()
        r = subprocess.run(argv_, cwd=clone, env=run_env, capture_output=True, text=True)
        took = time.perf_counter() - t0
        status = "ok  " if r.returncode == 0 else f"FAIL {r.returncode}"
        print(f"[{n:2}] {status} {took:6.1f} s  {shown}", flush=True)
        if r.returncode != 0:
            failed += 1
            print("     " + "\n     ".join((r.stderr or r.stdout).strip().splitlines()[-5:]))
    print(f"left out (not runnable here as written): {', '.join(SKIPPED_TOOLS)} commands")
    print(f"{len(commands) - failed} of {len(commands)} commands worked")
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
