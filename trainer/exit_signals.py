"""A rank dies with its torchrun agent, and says where it was when it is stopped.

torchrun starts every rank in a session of its own and cleans them up when it is *asked* to stop (SIGTERM, SIGINT).
When the agent itself is SIGKILLed (or the tuner above it is, and the kernel's parent-death signal takes the agent
down) nothing is left to clean up: the ranks would go on holding their GPUs, blocked in a collective forever.
``prctl(PR_SET_PDEATHSIG)`` makes the kernel deliver a signal to this process when its parent exits, whatever the
reason. DataLoader workers need nothing of the kind: they poll ``getppid()`` and exit when their rank is gone.

Linux only; elsewhere (and outside torchrun, where the parent is a shell or a user's own launcher) it does nothing.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (the torchrun agent) exits. Returns whether
    the signal is set. Call it first thing: a rank orphaned before the call exits at once."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # The agent may have died between reading its pid and the prctl: then nobody will ever signal us. (Not
    # ``parent == 1``: in a container torchrun itself may be PID 1.)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def stacks_on_sigterm() -> None:
    """A rank stopped from outside (a peer failed, the tuner's hang deadline) prints every thread's stack on its way
    out: where a rank waits is what a hang's report needs, and only the stopped rank knows it.

    Into a file of the rank's own when the launcher names a folder (``TRAINER_STACKS_DIR``): ranks stopped at the
    same moment, writing into one stream, interleave their stacks fragment by fragment. A process the rank forks (a
    DataLoader worker) gets a file of its own there too: a rank waiting for its next batch is only half of a hang's
    story, the worker that does not deliver it is the other. Without a folder, forked children print nothing: their
    stacks would interleave with the rank's."""
    folder = os.environ.get("TRAINER_STACKS_DIR")
    if not (folder and os.path.isdir(folder)):
        faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
        os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))
        return
    rank = os.environ.get("RANK", "0")
    _OWN.path, _OWN.pid = os.path.join(folder, f"rank{rank}-pid{os.getpid()}.txt"), os.getpid()
    _stacks_into(_OWN.path)
    # A worker's file is opened in the worker: the fork's own pid names it, and a worker of a worker (rare) nests.
    os.register_at_fork(after_in_child=lambda: _stacks_into(
        os.path.join(folder, f"rank{rank}-worker-pid{os.getpid()}.txt")))


def rearm() -> None:
    """The rank's stack printer back in front of a SIGTERM handler installed since (a framework's own: Lightning
    installs one as its fit starts, which replaces it); that handler still runs after the stacks are written. Nothing
    where ``stacks_on_sigterm`` wrote no file of the rank's own."""
    if _OWN.path is None or os.getpid() != _OWN.pid:
        return
    # faulthandler still holds the signal as registered and would not install itself again: unregistered, it puts
    # back the handler it found at first, so the framework's is set again before the printer goes in front of it.
    framework = signal.getsignal(signal.SIGTERM)
    faulthandler.unregister(signal.SIGTERM)
    if framework is not None:
        signal.signal(signal.SIGTERM, framework)
    _stacks_into(_OWN.path)


class _Own:
    path: str | None = None
    """The rank's stacks file (``stacks_on_sigterm``), and the process it is of (a forked worker has its own)."""

    pid: int | None = None


_OWN = _Own()


def _stacks_into(path: str) -> None:
    """This process's threads' stacks into ``path`` when it gets SIGTERM, which then ends it as it would have."""
    try:
        out = open(path, "w")  # noqa: SIM115 - faulthandler writes to it until the process ends
    except OSError:  # a folder gone with its launcher: no stacks, and the signal ends the process as before
        faulthandler.unregister(signal.SIGTERM)
        return
    faulthandler.register(signal.SIGTERM, file=out, all_threads=True, chain=True)
