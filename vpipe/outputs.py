"""Output paths checked before any work, so a long run never dies at its end on a bad path.

Commands call :func:`check_output_file` for each file they will write and
:func:`check_output_dir` for a directory they fill (``vpipe bench --out``); both raise a
one-line :class:`OutputError` naming the path and the problem. A non-empty output directory is
refused unless the user asks to append to it or to replace it, so nothing stored is lost by
accident. :func:`atomic_write` writes a file through a temporary sibling that is removed on any
error; :func:`staged_dir` fills a whole directory that way, so Ctrl-C at any moment leaves the
previous complete output or the new complete one. Files and directories follow the umask.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
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
    ``force`` (its contents will be replaced: see :func:`staged_dir`)."""
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


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed onto ``path`` on success and removed
    on any error, so no half-written or temporary file is left behind."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600: follow the umask instead
        yield Path(tmp)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike[str], writer: Callable[[Path], object]) -> None:
    """``writer(tmp)`` then rename onto ``path`` (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        writer(tmp)


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def kept_note(path: Path) -> str:
    """What an interrupted command leaves at ``path`` before its new output is swapped in."""
    if path.is_dir() and any(path.iterdir()):
        return f"{path} kept as it was (the previous complete output)"
    return f"nothing written to {path}"


@contextmanager
def staged_dir(path: str | os.PathLike[str], *, keep: bool = False) -> Iterator[Path]:
    """A temporary sibling directory of ``path`` to fill (holding a copy of ``path``'s contents
    when ``keep``); swapped in for ``path`` when the block ends without error, removed otherwise.

    Ctrl-C during the block leaves ``path`` as it was and re-raises KeyboardInterrupt with a
    note saying so; Ctrl-C during the swap is held until the swap is done, then raised with a
    note that ``path`` holds the new complete output."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        # Held from the directory's making to its name being kept: a Ctrl-C that landed between
        # the two (a descheduled process on a loaded host) would leave it behind.
        with sigint_held() as held:
            tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.vpipe-new-", dir=p.parent))
        if held:
            raise KeyboardInterrupt
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700
        if keep and p.is_dir():
            shutil.copytree(p, tmp, symlinks=True, dirs_exist_ok=True)
        yield tmp
    except KeyboardInterrupt:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise KeyboardInterrupt(kept_note(p)) from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    with sigint_held() as held:
        _swap_in(tmp, p)
    if held:
        raise KeyboardInterrupt(f"{p} holds this run's complete output")


def _swap_in(new: Path, path: Path) -> None:
    """Put directory ``new`` at ``path``; the old ``path`` (if any) is moved aside, then removed."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    if not path.exists():
        os.rename(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.vpipe-old-", dir=path.parent))
    os.rename(path, old / path.name)
    os.rename(new, path)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def sigint_held() -> Iterator[list[int]]:
    """SIGINT is recorded, not raised, inside the block (main thread only; elsewhere nothing
    changes); the yielded list holds the signals that came. Python runs its handler in the main
    thread whichever thread the signal reached, so this holds a Ctrl-C where blocking the
    signal in one thread would not."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
