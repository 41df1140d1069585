"""What a trial is worth: the job's windows + the NVML samples → Optuna value(s), state and user attrs.

* ``throughput`` (default): global imgs/s, the estimate over the measured span (``trainer.estimate``: samples over
  the slowest rank's seconds); its 95 % interval goes into the trial's attrs, Optuna's value stays the estimate.
* ``pareto``: (imgs/s, NVML utilization %) maximized jointly; ``autotune export`` picks from the front.
* ``weighted``: ``imgs_per_s**w_t * (util/100)**w_u * power_w**(-w_p)`` — a product of powers, so it does not
  depend on units and ``w_t = w_p = 1`` is images per joule.

Why throughput is the default: utilization rewards slow kernels, and the slowest configurations often show the
highest utilization (docs/benchmarks.md).

Failures: a config the job cannot run (``oom``, ``config``, ``diverged``: ``trainer.protocol.CONFIG_FAILURES``) is a
*completed, infeasible* trial: an Optuna constraint above zero, which TPE ranks by violation, never by value, so it
learns "this combination fails" rather than "this pipeline is slow"; Optuna needs a value for a completed trial, and
``INFEASIBLE_VALUE`` is only that (no throughput figure is recorded for such a trial). Environment failures (``nccl``,
``hang``, ``loader``, ``crash``) are FAIL: they say nothing about the config, so the sampler must not learn from them
(``autotune.study.view.Outcome.ended``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from autotune.exceptions import SpecError
from trainer.estimate import estimate
from trainer.protocol import COMPILED_ONLY

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


MEASURED = ("imgs_per_s", "imgs_per_s_windows", "ci_low", "ci_high", "ci_half_width", "ci_batches",
            "ci_batch_windows", "steady_start", "imgs_per_s_steady", "epoch_turns", "epoch_turn_s", "precise",
            "ended", "measured_s", "peak_mem_bytes", "loss_finite", "loss_start", "loss_end", "data_wait_share",
            "step_split", "versions")
"""What a trial keeps of its run's summary (``trainer.protocol.SummaryRecord``)."""


def measured_attrs(windows: list[dict], summary: dict | None) -> dict[str, Any]:
    """Throughput attrs: the job's summary (the estimate, its interval and what it stands on), or for a run without
    one (killed after some windows) the estimate of the windows that arrived."""
    if summary and summary.get("imgs_per_s") is not None:
        out = {k: summary[k] for k in MEASURED if summary.get(k) is not None}
        out["imgs_per_s"] = float(out["imgs_per_s"])
        # What a compiled run paid for its compile: the stage planner prices a compile by it.
        out.update({k: summary[k] for k in COMPILED_ONLY if summary.get(k) is not None})
        return out
    timed = [SimpleNamespace(images=float(w.get("images") or 0), seconds=float(w.get("seconds") or 0),
                             turn=bool(w.get("turn"))) for w in windows]
    est = estimate(timed, final=True) if timed else None
    if est is None:
        return {}
    return {"imgs_per_s": est.value, "imgs_per_s_windows": [float(w.get("imgs_per_s") or 0) for w in windows],
            **est.record(), "precise": False}
