"""What a trial is worth: the job's windows + the NVML samples → Optuna value(s), state and user attrs.

* ``throughput`` (default): global imgs/s, the median over the timed windows (slowest rank's wall time).
* ``pareto``: (imgs/s, NVML utilization %) maximized jointly; ``autotune export`` picks from the front.
* ``weighted``: ``imgs_per_s**w_t * (util/100)**w_u * power_w**(-w_p)`` — a product of powers, so it does not
  depend on units and ``w_t = w_p = 1`` is images per joule.

Why throughput is the default: utilization rewards slow kernels (on 2xH200 the fastest real-data config measured
46 % while a slower one measured 59 %).

Failures: a config the job cannot run (``oom``, ``config``, ``diverged``: ``trainer.protocol.CONFIG_FAILURES``) is a
*completed, infeasible* trial: an Optuna constraint above zero, which TPE ranks by violation, never by value, so it
learns "this combination fails" rather than "this pipeline is slow"; Optuna needs a value for a completed trial, and
``INFEASIBLE_VALUE`` is only that (no throughput figure is recorded for such a trial). Environment failures (``nccl``,
``hang``, ``loader``, ``crash``) are FAIL: they say nothing about the config, so the sampler must not learn from them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from autotune.exceptions import SpecError
from trainer.protocol import COMPILED_ONLY, Failure

INFEASIBLE_VALUE = 0.0
"""The value Optuna stores for an infeasible trial (for each objective); its constraint is what counts."""


@dataclass(kw_only=True)
class Objective:
    kind: str = "throughput"
    weights: dict[str, float] | None = None

    @property
    def directions(self) -> list[str]:
        return ["maximize", "maximize"] if self.kind == "pareto" else ["maximize"]

    @property
    def multi(self) -> bool:
        return self.kind == "pareto"

    @property
    def needs_util(self) -> bool:
        w = self.weights or {}
        return self.kind == "pareto" or (self.kind == "weighted" and (w.get("util", 0) or w.get("power", 0)))

    def check(self, util_available: bool, reason: str) -> None:
        """Refuse objectives that need NVML on a machine without it, before any trial runs."""
        if self.needs_util and not util_available:
            what = "pareto" if self.kind == "pareto" else "weighted with util/power weights"
            raise SpecError([f"objective {what} needs NVML GPU utilization, which is unavailable here ({reason}); "
                             "use --objective throughput"], "objective")

    def values(self, attrs: dict[str, Any]) -> list[float]:
        """Value(s) of a measured trial from its attrs (``imgs_per_s``, ``util_mean``, ``power_mean_w``)."""
        ips = float(attrs["imgs_per_s"])
        if self.kind == "throughput":
            return [ips]
        util = attrs.get("util_mean")
        if self.kind == "pareto":
            return [ips, float(util or 0.0)]
        w = {"throughput": 1.0, "util": 0.0, "power": 0.0, **(self.weights or {})}
        score = ips ** w["throughput"]
        if w["util"]:
            score *= (max(float(util or 0.0), 0.0) / 100.0) ** w["util"]
        if w["power"]:
            power = attrs.get("power_mean_w")
            score *= float(power) ** (-w["power"]) if power else 0.0
        return [score]

    def infeasible_values(self) -> list[float]:
        return [INFEASIBLE_VALUE] * len(self.directions)


def measured_attrs(windows: list[dict], summary: dict | None) -> dict[str, Any]:
    """Throughput attrs. Prefer the job's summary (it decides the windows and the median); a run without one (killed
    or pruned after some windows) falls back to the median of the windows that arrived."""
    if summary and summary.get("imgs_per_s") is not None:
        out = {
            "imgs_per_s": float(summary["imgs_per_s"]),
            "imgs_per_s_windows": [float(x) for x in summary.get("imgs_per_s_windows", [])],
            "spread": summary.get("spread"),
            "peak_mem_bytes": summary.get("peak_mem_bytes"),
            "loss_finite": summary.get("loss_finite"),
            "loss_start": summary.get("loss_start"),
            "loss_end": summary.get("loss_end"),
            "settled": summary.get("settled"),
        }
        if summary.get("versions"):
            out["versions"] = summary["versions"]
        # What a compiled run paid for its compile: the stage planner prices a compile by it.
        out.update({k: summary[k] for k in COMPILED_ONLY if summary.get(k) is not None})
        return out
    xs = [float(w["imgs_per_s"]) for w in windows if w.get("imgs_per_s") is not None]
    if not xs:
        return {}
    med = statistics.median(xs)
    return {"imgs_per_s": med, "imgs_per_s_windows": xs,
            "spread": (max(xs) - min(xs)) / med if med > 0 else None}


def state_for(failure: Failure | None) -> str:
    """``complete``, ``infeasible`` or ``fail`` for a failure class (None: success)."""
    if failure is None:
        return "complete"
    return "infeasible" if Failure(failure).caused_by_config else "fail"
