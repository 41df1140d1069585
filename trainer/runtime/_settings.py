"""A run's settings: the trial's value of each, else the value a helper was given, else the script's declared
default, else the library's; what the script read and what the helpers applied (its ``settings`` record)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainer.apply import cudnn_benchmark
from trainer.knobs import table
from trainer.runtime._base import _UNSET
from trainer.runtime.request import Request


class Settings:
    """The settings part of a run (``trainer.runtime._run.Run``): ``run.NAME`` reads one the script declared
    (``read``); the helpers apply theirs (``apply``); the record of what the script runs with (``settings``) is what
    it read and what they applied."""

    def __init__(self, request: Request, declared: dict[str, Any]):
        self.request = request
        self._declared = dict(declared)
        self._read: set[str] = set()
        self._applied: dict[str, Any] = {}

    def read(self, name: str) -> Any:
        """``run.NAME``: a setting the script reads itself, noted as read."""
        if name not in table().by_runtime_name:
            raise AttributeError(name)
        if not self.has(name):
            raise AttributeError(f"run.{name}: not declared; pass {name}=<the script's default> to runtime.setup()")
        self._read.add(name)
        return self.value(name)

    def has(self, name: str) -> bool:
        """Whether the run sets ``name`` or the script declared its default."""
        return name in self.request.settings or name in self._declared

    def was_read(self, name: str) -> bool:
        return name in self._read

    def unread(self) -> list[str]:
        """The settings the script declared that it never read and no helper applied."""
        return [n for n in self._declared if n not in self._read and n not in self._applied]

    def value(self, name: str, default: Any = _UNSET) -> Any:
        """The run's value, else the helper's argument, else the script's declared default, else the library's."""
        if name in self.request.settings:
            return self.request.settings[name]
        if default is not _UNSET:
            return default
        if name in self._declared:
            return self._declared[name]
        return table().by_runtime_name[name].runtime_default

    def apply(self, name: str, default: Any = _UNSET) -> Any:
        """``value``, recorded as applied: a setting a helper applies is one the search may change."""
        value = self._applied[name] = self.value(name, default)
        return value

    def record(self, name: str, value: Any) -> None:
        """What a helper really applied where it differs from the value it was given (a DataLoader's own prefetch
        depth where it was given none)."""
        self._applied[name] = value

    def applied(self, name: str, default: Any = None) -> Any:
        """The value a helper applied, else ``default``."""
        return self._applied.get(name, default)

    def replace(self, old: Iterable[str], new: dict[str, Any]) -> None:
        """The record's ``old`` settings (those of the loader the run no longer trains on) replaced by ``new``."""
        for name in old:
            self._applied.pop(name, None)
        self._applied.update(new)

    @property
    def accum(self) -> int:
        """The micro-steps of an optimizer step, as applied (1 where no helper applied any)."""
        return max(1, int(self._applied.get("accum_steps", 1)))

    def settings(self) -> dict[str, Any]:
        """What the script runs with: every setting it read or a helper applied, by name."""
        return {**{n: self.value(n) for n in self._read}, **self._applied}

    @property
    def in_search(self) -> bool:
        """A search's trial (or a stage's measurement): ``report()`` may end the run."""
        return self.request.mode in ("measure", "supply", "ceiling")

    def apply_cudnn(self) -> None:
        # Global to the process: set only when the run asks, else the script's (or torch's) own choice stands.
        self._applied["cudnn_benchmark"] = cudnn_benchmark(self.request.settings.get("cudnn_benchmark"))
