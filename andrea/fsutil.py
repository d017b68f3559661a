"""Atomic writes and file hashing, shared by every stage.

A result or checkpoint is written to a temp file in the same folder, fsynced, then
renamed over the target, so a crash leaves either the old file or the new one, never
a torn one. ``atomic_dir`` does the same for a folder of outputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from andrea.errors import AndreaError


def ordinary_mode(path: str | Path, mode: int = 0o666) -> None:
    """mkstemp/mkdtemp make 0600/0700; give a result the mode a plain open()/mkdir() would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort where a folder cannot be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", **kw) -> Iterator[Any]:
    """Open a temp file beside ``path``; on clean exit fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    ordinary_mode(tmp)
    try:
        with open(tmp, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def json_text(obj: Any, indent: int | None = 1) -> str:
    """The one JSON spelling of every result file (strict: NaN/inf raise ValueError)."""
    return json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False) + "\n"


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    atomic_write_text(path, json_text(obj, indent))


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a folder in a temp sibling; on clean exit replace ``path`` with it.

    On any error the temp folder is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    ordinary_mode(tmp, 0o777)
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | Path, what: str) -> dict:
    """A JSON object from ``path``; a missing, malformed or non-object file is an AndreaError naming it."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AndreaError(f"{path}: {what} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AndreaError(f"{path}: {what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise AndreaError(f"{path}: {what} must be a JSON object")
    return d
