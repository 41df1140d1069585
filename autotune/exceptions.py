"""The tuner's exception hierarchy. Every error a user can cause is an `AutotuneError` with a one-line message that
names the fix; the CLI prints it without a traceback (``--debug`` shows one)."""

import signal


class AutotuneError(Exception):
    """Base class: ``str(e)`` is the one line shown to the user."""

    exit_code = 2


class SpecError(AutotuneError):
    """A StudySpec is invalid (all problems are listed)."""

    def __init__(self, problems: list[str], source: str = "spec"):
        self.problems = list(problems)
        super().__init__(f"{source}: " + "; ".join(self.problems))


class StorageError(AutotuneError):
    """The study storage cannot be reached or does not hold what was asked for."""


class DataError(AutotuneError):
    """A data folder is missing, empty or malformed."""


class LaunchError(AutotuneError):
    """A trial cannot be launched (bad world size, unsafe environment, torchrun missing)."""


class GPUError(AutotuneError):
    """The GPUs asked for are not there."""


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, handled as Ctrl-C is (what runs is killed and recorded); the exit code says which signal, as
    a shell's does (128 + its number)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated ({signal.Signals(signum).name})")
