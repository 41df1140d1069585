"""Whether every file of an ImageFolder is a readable image, checked before trial 0 (a bad file fails every trial):
bounded work per file (its first and last bytes and its header, never the pixels), on threads that wait on the
disk."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from autotune.exceptions import DataError
from autotune.search.prepare._data_check import DataCheck, check_progress, files_signature
from trainer.config import ConfigError, TrainConfig
from trainer.data.files import resolve_splits

CHECK_TAIL_BYTES = 1024
"""A JPEG's end marker is looked for in this many last bytes: some writers pad a file after it."""

CHECK_THREADS = 8
"""Threads checking files: they wait on the disk (a network file system's latency) more than they compute."""


def image_problem(path: str) -> str | None:
    """Why the file cannot be a training image (None: it can): unreadable, empty, a JPEG without its start or end
    marker (cut short), a PNG without its end chunk, or a header PIL cannot parse. Reads the first and last bytes
    and the header, never the pixels: bounded work per file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            head = f.read(16)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - CHECK_TAIL_BYTES))
            tail = f.read()
            if not head:
                return "an empty file"
            if head[:2] == b"\xff\xd8" and b"\xff\xd9" not in tail:
                return "a JPEG cut short (no end marker)"
            if head[:8] == b"\x89PNG\r\n\x1a\n" and b"IEND" not in tail:
                return "a PNG cut short (no end chunk)"
            f.seek(0)
            try:
                with Image.open(f):  # parses the header, never the pixels
                    pass
            except (UnidentifiedImageError, ValueError, SyntaxError, EOFError) as e:
                return f"PIL cannot read its header ({e})"
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    return None


def unreadable_images(paths: list[str], chunk: int = 512,
                      progress: Callable[[int], None] | None = None) -> list[tuple[str, str]]:
    """(path, why) of every file in ``paths`` that ``image_problem`` rejects, in the order given. ``progress`` is
    called (on the caller's thread) with the number of files of each part checked."""
    def check(part: list[str]) -> list[tuple[str, str]]:
        return [(p, why) for p in part if (why := image_problem(p)) is not None]

    parts = [paths[i:i + chunk] for i in range(0, len(paths), chunk)]
    pool = ThreadPoolExecutor(CHECK_THREADS)
    try:
        futures = {pool.submit(check, part): len(part) for part in parts}
        if progress is not None:
            for done in as_completed(futures):
                progress(futures[done])
        found = [bad for f in futures for bad in f.result()]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C, SIGTERM: stop now, not after a million files
        raise
    pool.shutdown()
    return found


def check_images(base: TrainConfig, where: str, cache: Path | None = None) -> DataCheck:
    """An ImageFolder with no image (or a validation split that does not match), or with a file that is no image,
    fails every trial: say so now. A folder whose files are unchanged since a clean check recorded in ``cache``
    (``DataCheck``) is not checked again."""
    try:
        train, val = resolve_splits(base)
    except ConfigError as e:
        raise DataError(f"{where}: {'; '.join(e.problems)}; it needs one folder per class with JPEG/PNG files in "
                        "them (`autotune make-data DIR --images N --classes C` makes one)") from None
    paths = [p for split in (train, val) if split is not None for p, _ in split.samples]
    checked = DataCheck(path=str(Path(base.data.path).resolve()), files=len(paths), signature=files_signature(paths),
                        cache=cache)
    if checked.recorded():
        return checked
    with check_progress(len(paths), checked.path) as step:
        bad = unreadable_images(paths, progress=step)
    if bad:
        path, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DataError(f"{where}: {path} is not a readable image: {why}{more}; remove or replace "
                        f"{'it' if len(bad) == 1 else 'them'} (every file of the folder was checked)")
    return checked
