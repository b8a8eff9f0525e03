"""Output paths checked before any work, so a long run never dies at its end on a bad path.

Commands call :func:`check_output_file` for each file they will write and
:func:`check_output_dir` for a directory they fill (``vpipe bench --out``); both raise a
one-line :class:`OutputError` naming the path and the problem. A non-empty output directory is
refused unless the user asks to append to it or to replace it, so nothing stored is lost by
accident. :func:`atomic_write` writes a file through a temporary sibling that is removed on any
error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vpipe.errors import VpipeError


class OutputError(VpipeError, ValueError):
    """An output path that cannot be written as asked."""


def _writable_dir(d: Path, what: str) -> None:
    """``d`` (created if missing) accepts new files, else OutputError."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".vpipe-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except (FileExistsError, NotADirectoryError):
        raise OutputError(f"{what} {d}: a file is in the way of the directory") from None
    except OSError as e:
        raise OutputError(f"{what} {d}: cannot write there: {e.strerror or e}") from None


def check_output_file(path: str | os.PathLike[str], what: str = "output") -> Path:
    """A file path to write: not a directory, its directory writable (created if missing)."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{what} {p} is a directory: give a file name")
    _writable_dir(p.parent if str(p.parent) else Path("."), what)
    return p


def check_output_dir(
    path: str | os.PathLike[str],
    *,
    append: bool = False,
    force: bool = False,
    flag: str = "--out",
) -> Path:
    """A directory to fill: writable, and empty unless ``append`` (add to what is there) or
    ``force`` (its contents will be replaced: see :func:`clear_dir`)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {p} is a file, not a directory")
    if append and force:
        raise OutputError("--append and --force exclude each other")
    if p.is_dir() and any(p.iterdir()) and not (append or force):
        raise OutputError(
            f"{flag} {p} is not empty: use --append to add to it, --force to replace it, "
            "or another directory"
        )
    _writable_dir(p, flag)
    return p


def clear_dir(path: Path) -> None:
    """Remove everything inside ``path`` (``--force``, once the new results are in hand)."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed onto ``path`` on success and removed
    on any error, so no half-written or temporary file is left behind."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike[str], writer: Callable[[Path], object]) -> None:
    """``writer(tmp)`` then rename onto ``path`` (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        writer(tmp)
