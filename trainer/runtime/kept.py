"""A script's persistent DataLoader workers, kept by a live worker from one trial to the next.

On a live worker (``trainer.worker.serve``) a script's function runs again for every trial, builds its Dataset and
calls ``run.loader`` again, and each trial would start the loader's workers anew. Where a trial's loader keeps its
workers between epochs (``persistent_workers``) and the next trial's loader would start workers that hold the same
data with the same settings, the next trial resumes the kept ones instead, as a run's next epoch does: its own
sampler (order, batch size, ``set_epoch``) drives them.

"The same data" is decided by what a worker receives: a DataLoader's worker holds a copy of its dataset, collate
function and worker init function, as ``pickle`` would make it (the ``spawn`` start method copies exactly so).
The two loaders' copies must pickle to the same bytes, together with every setting fixed when workers start
(worker count, prefetch depth, pinning, timeout, batched or not, ``drop_last``, ``in_order``); the batch size and
the sampler are the main process's and may change. A dataset that does not pickle (a lambda transform, an open
file), pickles larger than ``MAX_BYTES``, a DataLoader subclass or one given its own multiprocessing context is
never kept: its trials start their own workers, as they always did. A dataset whose ``__getstate__`` leaves out
what its items depend on would defeat the comparison: such a dataset must pickle what its items are made from.
As across a run's epochs, the kept workers' random streams go on from where they were, and what they cached is
kept.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import threading
from typing import Any

MAX_BYTES = 256 << 20
"""Largest pickled dataset compared (an ImageFolder of a few million files; a dataset holding its samples in memory
is larger, and is not kept: comparing it would cost what starting its workers costs)."""

_KEPT: dict[bytes, Any] = {}
"""Kept loader iterators (torch's multi-process one) by the digest of what their workers hold."""


class _TooLarge(Exception):
    pass


class _Digest(io.RawIOBase):
    """A file that hashes what is written to it, refusing more than ``MAX_BYTES``."""

    def __init__(self) -> None:
        self.hash, self.size = hashlib.blake2b(digest_size=32), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.size += len(data)
        if self.size > MAX_BYTES:
            raise _TooLarge()
        self.hash.update(data)
        return len(data)


def key(loader: Any) -> bytes | None:
    """The digest of what ``loader``'s workers hold and are fixed with, where its workers may be kept; else None."""
    from torch.utils.data import DataLoader

    if type(loader) is not DataLoader or not loader.persistent_workers or not loader.num_workers \
            or loader.multiprocessing_context is not None:
        return None
    fixed = (loader.dataset, loader.collate_fn, loader.worker_init_fn, loader.num_workers, loader.prefetch_factor,
             loader.pin_memory, getattr(loader, "pin_memory_device", ""), loader.timeout,
             loader.batch_sampler is not None, loader.drop_last, getattr(loader, "in_order", True))
    out = _Digest()
    try:
        pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(fixed)
    except Exception:  # anything that does not pickle cannot be compared
        return None
    return out.hash.digest()


def resume(loader: Any, digest: bytes | None) -> bool:
    """Hand ``loader`` the kept workers of ``digest`` (its next ``iter`` resumes them with its own sampler); kept
    workers of anything else are ended, since this process no longer runs the trials they were kept for. Whether
    ``loader`` got workers."""
    found = _KEPT.pop(digest, None) if digest is not None else None
    release()
    if found is None:
        return False
    found._index_sampler = loader._index_sampler  # the resumed epoch's indices come from this trial's sampler
    loader._iterator = found
    return True


def keep(digest: bytes, iterator: Any) -> bool:
    """Keep ``iterator``'s workers for a next trial on the same data (``resume``), where every one of them still
    runs; whether they are kept."""
    workers = getattr(iterator, "_workers", None)
    if not workers or getattr(iterator, "_shutdown", True) or not all(w.is_alive() for w in workers):
        return False
    previous = _KEPT.pop(digest, None)
    if previous is not None and previous is not iterator:
        end(previous)
    _KEPT[digest] = iterator
    return True


def release() -> None:
    """End every kept worker (nothing will resume them)."""
    while _KEPT:
        end(_KEPT.popitem()[1])


def processes() -> set[int]:
    """The kept workers' process ids: the live worker's, not a trial's leftovers."""
    return {w.pid for it in _KEPT.values() for w in getattr(it, "_workers", ())}


def threads() -> set[threading.Thread]:
    """The kept loaders' threads: each worker's queue feeder, and the pin-memory thread."""
    found = set()
    for it in _KEPT.values():
        queues = [*getattr(it, "_index_queues", ()), getattr(it, "_worker_result_queue", None)]
        found |= {getattr(q, "_thread", None) for q in queues} | {getattr(it, "_pin_memory_thread", None)}
    return {t for t in found if isinstance(t, threading.Thread)}


def end(iterator: Any) -> None:
    """``iterator``'s workers joined."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
