"""A run's settings: the trial's value of each, else the value a helper was given, else the script's declared
default, else the library's; what the script read and what the helpers applied (its ``settings`` record)."""

from __future__ import annotations

from typing import Any

from trainer.apply import cudnn_benchmark
from trainer.knobs import table
from trainer.runtime._base import _UNSET


class Settings:
    """``run.NAME`` reads a declared setting; the helpers apply theirs through ``_apply``."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in table().by_runtime_name:
            raise AttributeError(name)
        if name not in self._declared and name not in self.request.settings:
            raise AttributeError(f"run.{name}: not declared; pass {name}=<the script's default> to runtime.setup()")
        self._read.add(name)
        return self._value(name)

    def _value(self, name: str, default: Any = _UNSET) -> Any:
        """The run's value, else the helper's argument, else the script's declared default, else the library's."""
        if name in self.request.settings:
            return self.request.settings[name]
        if default is not _UNSET:
            return default
        if name in self._declared:
            return self._declared[name]
        return table().by_runtime_name[name].runtime_default

    def _apply(self, name: str, default: Any = _UNSET) -> Any:
        value = self._applied[name] = self._value(name, default)
        return value

    def settings(self) -> dict[str, Any]:
        """What the script runs with: every setting it read or a helper applied, by name."""
        return {**{n: self._value(n) for n in self._read}, **self._applied}

    @property
    def in_search(self) -> bool:
        """A search's trial (or a stage's measurement): ``report()`` may end the run."""
        return self.request.mode in ("measure", "supply", "ceiling")

    def _apply_cudnn(self) -> None:
        # Global to the process: set only when the run asks, else the script's (or torch's) own choice stands.
        self._applied["cudnn_benchmark"] = cudnn_benchmark(self.request.settings.get("cudnn_benchmark"))
