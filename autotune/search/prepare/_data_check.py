"""The data check's record: a clean check of a folder's files is kept in the data cache with a signature of the
files, so a later search whose files are unchanged skips it; and how a long check shows its progress."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CHECK_FORMAT = 1
"""Bumped whenever ``image_problem`` accepts less than before, so a folder an older check passed is checked again."""

MANY_FILES = 20_000
"""A check of more files than this says so in a line when its progress cannot be shown live (stderr no terminal)."""

PROGRESS_AFTER_S = 3.0
"""A check still running after this long shows its progress (files checked / total) on a terminal."""


@dataclass(kw_only=True)
class DataCheck:
    """The check of a data folder's files. A clean check is recorded in the data cache (a small JSON file per folder,
    by its resolved path) with a signature of the files it checked; a later search whose files have the same
    signature skips the check (ImageNet's 1.3 M files would be a long wait at every search start, also on resume). A
    failing check is never recorded."""

    path: str
    """The folder, resolved."""

    files: int
    signature: str
    """``files_signature`` of the files checked."""

    cache: Path | None = None
    """The data cache folder (``data_cache_root``); None: nothing is recorded."""

    skipped: bool = False
    """The files are unchanged since a recorded clean check, so they were not checked again."""

    @property
    def record_path(self) -> Path | None:
        if self.cache is None:
            return None
        key = hashlib.sha256(self.path.encode()).hexdigest()[:20]
        return self.cache / "checked" / f"{Path(self.path).name[:40]}-{key}.json"

    def recorded(self) -> bool:
        """Whether a clean check of exactly these files is on record (sets ``skipped``)."""
        record = self.record_path
        try:
            stored = json.loads(record.read_text()) if record is not None else None
        except (OSError, ValueError):
            stored = None  # none yet, or unreadable: check (and record it afresh)
        self.skipped = (isinstance(stored, dict) and stored.get("format") == CHECK_FORMAT
                        and stored.get("path") == self.path and stored.get("signature") == self.signature)
        return self.skipped

    def settle(self, say) -> None:
        """Once every other check passed: say that the check was skipped, or record the clean one."""
        if self.skipped:
            say(f"autotune: data: {self.path} checked before ({self.files} files unchanged since); not checked "
                "again")
            return
        record = self.record_path
        if record is None:
            return
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")  # two searches starting at once
            tmp.write_text(json.dumps({"format": CHECK_FORMAT, "path": self.path, "files": self.files,
                                       "signature": self.signature, "checked_at": time.time()}))
            os.replace(tmp, record)
        except OSError:
            pass  # a cache that cannot be written costs the next search its check again, nothing more


def files_signature(paths: list[str]) -> str:
    """A hash of the sorted (path, size, mtime_ns, ctime_ns) of ``paths``: any file added, removed, rewritten or
    touched changes it (ctime too: a copy that kept another file's mtime and size is still a change). Stats come
    from one ``os.scandir`` per folder; a file missing there counts as missing. Costs a stat per file, no read."""
    by_folder: dict[str, set[str]] = {}
    for p in paths:
        folder, name = os.path.split(p)
        by_folder.setdefault(folder, set()).add(name)
    rows = []
    for folder, names in by_folder.items():
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name in names:
                        try:
                            st = e.stat()
                        except OSError:
                            continue
                        rows.append(f"{e.path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n")
        except OSError:
            continue
    rows.sort()
    h = hashlib.sha256(f"{len(paths)} {len(rows)}\n".encode())
    for r in rows:
        h.update(r.encode())
    return h.hexdigest()


@contextmanager
def check_progress(total: int, root: str) -> Iterator[Callable[[int], None] | None]:
    """How a long check shows its progress on stderr, as ``make-data`` does: on a terminal, a live line of files
    checked / total once the check has run ``PROGRESS_AFTER_S``; elsewhere (a log file, CI), one line at the start
    when it checks more than ``MANY_FILES`` files. Yields the callback for files done (None: nothing to show)."""
    if not sys.stderr.isatty():
        if total > MANY_FILES:
            print(f"autotune: data: checking every file of {root} ({total} files) before trial 0; a later search "
                  "skips this while they are unchanged", file=sys.stderr, flush=True)
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="file", desc=f"autotune: data: checking {root}", delay=PROGRESS_AFTER_S,
              dynamic_ncols=True) as bar:
        yield bar.update
