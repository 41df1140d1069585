"""A rank dies with its torchrun agent.

torchrun starts every rank in a session of its own and cleans them up when it is *asked* to stop (SIGTERM, SIGINT).
When the agent itself is SIGKILLed (or the tuner above it is, and the kernel's parent-death signal takes the agent
down) nothing is left to clean up: the ranks would go on holding their GPUs, blocked in a collective forever.
``prctl(PR_SET_PDEATHSIG)`` makes the kernel deliver a signal to this process when its parent exits, whatever the
reason. DataLoader workers need nothing of the kind: they poll ``getppid()`` and exit when their rank is gone.

Linux only; elsewhere (and outside torchrun, where the parent is a shell or a user's own launcher) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (the torchrun agent) exits. Returns whether
    the lifeline is in place. Call it first thing: a rank orphaned before the call exits at once."""
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
