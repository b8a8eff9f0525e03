"""Environments for the versions ``vpipe ab`` compares: a checkout and an installed vpipe each.

A version is a git revision of the current repository or a directory holding a vpipe
checkout. A revision gets a git worktree at its commit (detached) under the cache directory;
a directory is used where it is. Each gets a virtual environment of its own under the cache,
made cheap: created with ``--system-site-packages`` and without pip, it sees the packages of
the interpreter running ``vpipe ab`` (torch, pandas, ...: a ``.pth`` file lists that
interpreter's site directories), and only the version's vpipe is installed into it, editable,
with no dependencies and no network (``pip install --no-deps --no-build-isolation --no-index
-e``). Editable, so the installed vpipe lives in its checkout and records that checkout's
commit in its runs.

Like asv's environments, both are reused while what they were made from is unchanged: a
revision's worktree and environment are keyed by its commit; a directory's environment by its
path, and installed again when its ``pyproject.toml`` changes (an editable install follows
the directory's code). Whatever fails (an unknown revision, a checkout without vpipe, an
install pip refuses) is an :class:`EnvError` of one line naming the side and the version.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vpipe.errors import VpipeError

CACHE = ".vpipe-ab"  # under the repository root; git-ignored
STAMP = "vpipe-ab-env.json"


class EnvError(VpipeError, ValueError):
    """A version that cannot be prepared: what and why, in one line."""


@dataclass(frozen=True)
class Version:
    """One side of a comparison, ready to run: its label (A or B), what the user named, the
    checkout, the environment's Python, the commit (None for a directory outside git) and
    whether the environment was reused."""

    label: str
    name: str
    checkout: Path
    python: Path
    commit: str | None
    reused: bool

    @property
    def describe(self) -> str:
        where = f"{self.commit[:12]}" if self.commit else str(self.checkout)
        return f"{self.label} = {self.name} ({where})"


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd``'s output, run without PYTHONPATH, as the sides run (:mod:`vpipe.sweep.ab`): a
    PYTHONPATH naming the checkout ``vpipe ab`` runs from would have the new environment's
    check import that checkout's vpipe instead of the version's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no output"])[-1]


def repo_root(start: Path) -> Path:
    """The top of the git checkout holding ``start``."""
    out = _run(["git", "rev-parse", "--show-toplevel"], cwd=start)
    if out.returncode:
        raise EnvError(f"{start} is not inside a git checkout: {_last_line(out.stderr)}")
    return Path(out.stdout.strip())


def resolve_commit(repo: Path, revision: str) -> str | None:
    """The full commit of ``revision`` in ``repo``; None when git knows no such revision."""
    out = _run(["git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], cwd=repo)
    return out.stdout.strip() or None if out.returncode == 0 else None


def is_checkout(path: Path) -> bool:
    """Whether ``path`` holds a vpipe checkout (its package and its pyproject.toml)."""
    return (path / "pyproject.toml").is_file() and (path / "vpipe" / "__init__.py").is_file()


def prepare(label: str, name: str, repo: Path | None, cache: Path) -> Version:
    """The checkout and environment of one version (see the module's doc), made or reused."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not is_checkout(path):
            raise EnvError(f"{label} ({name}): not a vpipe checkout (no vpipe/ and pyproject.toml)")
        checkout = path.resolve()
        key = "dir-" + hashlib.sha256(str(checkout).encode()).hexdigest()[:12]
        commit = resolve_commit(checkout, "HEAD") if (checkout / ".git").exists() else None
    else:
        commit = resolve_commit(repo, name) if repo is not None else None
        if repo is None:
            raise EnvError(f"{label} ({name}): no such directory, and not inside a git checkout")
        if commit is None:
            raise EnvError(f"{label} ({name}): neither a directory nor a git revision of {repo}")
        checkout = worktree(repo, cache / "worktrees" / commit[:12], commit, label, name)
        key = commit[:12]
    python, reused = environment(cache / "envs" / key, checkout, label, name)
    return Version(label, name, checkout, python, commit, reused)


def worktree(repo: Path, path: Path, commit: str, label: str, name: str) -> Path:
    """A detached git worktree of ``commit`` at ``path``: the one already there when it is at
    that commit, else made anew."""
    if (path / ".git").exists() and resolve_commit(path, "HEAD") == commit:
        return path
    if path.exists():  # a leftover: an interrupted add, or another commit
        _run(["git", "worktree", "remove", "--force", str(path)], cwd=repo)
        if path.exists():
            import shutil

            shutil.rmtree(path)
    _run(["git", "worktree", "prune"], cwd=repo)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = _run(["git", "worktree", "add", "--detach", "--quiet", str(path), commit], cwd=repo)
    if out.returncode:
        raise EnvError(f"{label} ({name}): git worktree add failed: {_last_line(out.stderr)}")
    return path


def _fingerprint(checkout: Path) -> str:
    """What an environment's install depends on: the checkout and its pyproject.toml, and the
    interpreter whose packages it reuses."""
    text = (checkout / "pyproject.toml").read_bytes() + str(checkout).encode()
    return hashlib.sha256(text + sys.executable.encode() + sys.version.encode()).hexdigest()


def environment(env: Path, checkout: Path, label: str, name: str) -> tuple[Path, bool]:
    """The Python of ``env`` with ``checkout``'s vpipe installed in it (made, or reused when
    its stamp says it was made from the same inputs); and whether it was reused."""
    python = env / "bin" / "python"
    stamp = env / STAMP
    want = _fingerprint(checkout)
    try:
        if json.loads(stamp.read_text()).get("fingerprint") == want and python.exists():
            return python, True
    except (OSError, ValueError):
        pass
    stamp.unlink(missing_ok=True)
    if not python.exists():
        out = _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)])
        if out.returncode:
            raise EnvError(f"{label} ({name}): cannot create {env}: {_last_line(out.stderr)}")
    _share_packages(python)
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--no-index", "--ignore-installed", "-e", str(checkout)]  # fmt: skip
    out = _run(cmd, cwd=env)
    if out.returncode:
        raise EnvError(f"{label} ({name}): install failed: {_last_line(out.stderr + out.stdout)}")
    check = _run([str(python), "-c", "import vpipe; print(vpipe.__file__)"], cwd=env)
    where = Path(check.stdout.strip()) if check.returncode == 0 else None
    if where is None or checkout not in where.parents:
        why = _last_line(check.stderr) if check.returncode else f"vpipe imports from {where}"
        raise EnvError(f"{label} ({name}): installed, but {why}")
    stamp.write_text(json.dumps({"fingerprint": want, "checkout": str(checkout)}))
    return python, False


def _share_packages(python: Path) -> None:
    """A ``.pth`` in the new environment listing this interpreter's site directories, so that
    it sees what is installed here (paths only: their own ``.pth`` files, such as this
    checkout's editable vpipe, are not run there)."""
    out = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    if out.returncode:
        raise EnvError(f"{python}: not a working Python: {_last_line(out.stderr)}")
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    Path(out.stdout.strip(), "_vpipe_ab_shared.pth").write_text(
        "".join(f"{d}\n" for d in dirs if Path(d).is_dir())
    )
