"""What compiling a graph cost on this machine, kept beside the on-disk caches it was compiled into, so that a later
process can price a compile of the same graph before it runs one (the tuner's stages: ``autotune.search.stages``).

A compile that loads its graph from Inductor's FX graph cache and AOTAutograd's cache costs a fraction of a cold one,
also in a fresh process (docs/benchmarks.md), and those caches outlive the process: what one search compiled, the next
search, the export's re-measure and ``autotune train`` load. So the job (``trainer.compiled``) records every compile it
pays — not a graph a live worker reused — with whether the caches served it, in
``<compile cache dir>/autotune-compiles/<graph>.json``: the records sit in the folder whose contents they describe, and
a folder wiped takes them with it.

Light (no torch): the tuner reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.knobs import table

FOLDER = "autotune-compiles"
"""The records' folder inside a compile cache folder (``training.compile_cache_dir``)."""

KEEP = 8
"""Records kept per graph, the latest."""


def graph_key(cfg: Any, classes: int, world_size: int) -> str:
    """Everything that changes what a trial compiles or how its graphs are guarded (``trainer.knobs``: the settings
    of ``Table.graph_settings`` — the model, its input shape and dtype, the DDP wrapper (its buckets split the graph),
    the compile mode — with the head's ``classes`` and the world size), of a TrainConfig. Two runs with the same key
    compile the same graphs."""
    settings = {path: _setting(cfg, path) for path in table().graph_settings}
    settings["data.num_classes"] = classes
    return json.dumps({**settings, "world": world_size}, sort_keys=True, default=str)


def _setting(cfg: Any, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


@dataclass(frozen=True, kw_only=True)
class Paid:
    """One compile of a graph: what it cost, whether the on-disk caches served it, under which torch."""

    seconds: float
    from_caches: bool
    """Inductor and AOTAutograd found every graph of the compile in the caches (no miss)."""

    torch: str
    t: float
    """When (Unix time)."""


def _file(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def record(cache_dir: str | Path, key: str, paid: Paid) -> None:
    """Add ``paid`` to the graph's records (the latest ``KEEP``). Best effort: a folder that cannot be written loses
    the record, never the run."""
    path = _file(cache_dir, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        runs = [asdict(p) for p in read(cache_dir, key)] + [asdict(paid)]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "runs": runs[-KEEP:]}, indent=1))
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    except OSError:
        pass


def read(cache_dir: str | Path, key: str, torch: str | None = None) -> list[Paid]:
    """The graph's records in ``cache_dir``, oldest first; with ``torch`` (a version, its local part ignored:
    ``2.14.1`` matches ``2.14.1+cu130``), only that version's: another version's caches do not serve this one."""
    try:
        data = json.loads(_file(cache_dir, key).read_text())
        runs = [Paid(**r) for r in data["runs"]] if data.get("key") == key else []
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [p for p in runs if torch is None or p.torch.split("+")[0] == torch.split("+")[0]]

