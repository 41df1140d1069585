"""Files the commands write (an export's YAML, a report's page): checked before any work is done, so that a path
that cannot be written costs one line instead of a re-measure or a page built for nothing; a folder the path needs
is made with a word, never silently."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from autotune.exceptions import AutotuneError


class OutputError(AutotuneError):
    """A file a command would write cannot be written there."""


def check_output(path: str | Path, flag: str = "the output") -> Path | None:
    """Raises OutputError when ``path`` cannot be written; returns the folder it made for it (None: it existed).

    The folder is made and a file written in it here, not judged by its permission bits: ``os.access`` calls a
    folder writable for root that ``mkdir`` then refuses (``/proc``, a read-only mount's subfolder)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a folder: name the file to write, e.g. {path / 'out'}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"{flag} {path}: {folder} is a file, not a folder; choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: the folder {folder} is not writable; choose a path you can write")
    made = None if folder == path.parent else path.parent
    try:
        if made is not None:
            made.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        raise OutputError(f"{flag} {path}: {e.strerror or e} ({e.filename or path.parent}); choose a path you can "
                          "write") from None
    return made


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it (a reader never sees half a file), making its
    folder; a failure is one OutputError naming the path, and leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: {e.strerror or e}; choose a path you can write") from None
