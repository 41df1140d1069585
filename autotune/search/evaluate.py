"""Evaluate one trial: its configuration (drawn by the sampler, or set by a stage), the checks that make a launch
pointless (an invalid combination, an OOM already seen), the run on a live worker with the GPUs sampled, and what it
measured as trial attributes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.hw.nvml import Sampler, summarize
from autotune.objective import measured_attrs
from autotune.runner.pool import WorkerPool
from autotune.runner.trial import TrialJob, TrialRun
from autotune.search.progress import Progress
from autotune.space import predicted_oom
from autotune.study.liveness import Heartbeat, owner
from autotune.study.storage import set_trial_attrs
from autotune.study.view import MEASUREMENT_STAGES, TrialView
from trainer.config import ConfigError, TrainConfig
from trainer.protocol import Failure, Kind, nonfinite_reason


@dataclass(kw_only=True)
class Evaluation:
    """What a trial's evaluation found, before it is told to the study."""

    stage: str
    attrs: dict[str, Any] = field(default_factory=dict)
    config: TrainConfig | None = None
    failure: Failure | None = None
    message: str | None = None
    pruned: bool = False
    launched: bool = False


class Evaluator:
    """Runs trials for one search: the plan, the study (for what earlier trials learned) and a pool of workers."""

    def __init__(self, plan, study, pool: WorkerPool, progress: Progress, logs: Path):
        self.plan, self.study, self.pool, self.progress, self.logs = plan, study, pool, progress, logs
        self.me = owner()

    def __call__(self, trial, decided: dict[str, Any]) -> Evaluation:
        set_trial_attrs(trial, self.me)
        heartbeat = Heartbeat(trial)
        heartbeat.beat(force=True)
        stage = trial.user_attrs.get("stage") or "search"
        ev = Evaluation(stage=stage)
        trial_dir = self.logs / f"trial-{trial.number}"
        overrides = self.overrides(trial, stage)
        ev.attrs.update({"stage": stage, "log_path": str((trial_dir / "log.txt").resolve()),
                         "util_available": self.plan.util_available, "util_mean": None})
        try:
            ev.config = self.plan.base.with_overrides({**decided, **overrides, "name": f"{self.plan.name}-trial-"
                                                       f"{trial.number}", "output_dir": str(trial_dir)})
        except ConfigError as e:
            ev.failure, ev.message = Failure.CONFIG, "; ".join(e.problems)
            return ev
        prior = self.known_oom(ev.config.to_dict())
        if prior is not None:
            ev.failure = Failure.OOM
            ev.message = (f"trial {prior} ran out of memory at a batch <= this one with the same memory-relevant "
                          "settings; not launched")
            ev.attrs["oom_predicted_from"] = prior
            return ev
        self.launch(trial, ev, trial_dir, heartbeat)
        return ev

    def overrides(self, trial, stage: str) -> dict[str, Any]:
        if stage in MEASUREMENT_STAGES:
            return dict(trial.user_attrs.get("overrides") or {})
        return self.plan.space.suggest(trial, self.plan.base.to_dict())

    def known_oom(self, config: dict[str, Any]) -> int | None:
        """The trial that already ran out of memory at a batch <= this config's with the same memory-relevant
        settings (None: none did)."""
        ooms = []
        for t in self.study.get_trials(deepcopy=False):
            v = TrialView.of(t)
            if v.failure_class == Failure.OOM and v.config and not v.attrs.get("oom_predicted_from"):
                ooms.append((v.number, v.config))
        return predicted_oom(config, ooms)

    def launch(self, trial, ev: Evaluation, trial_dir: Path, heartbeat: Heartbeat) -> None:
        plan = self.plan
        job = TrialJob(config=ev.config, trial_dir=trial_dir, nproc_per_node=plan.nproc,
                       gpus=[g.uuid for g in plan.gpus] if plan.gpus else plan.entries,
                       torchrun_args=list(plan.torchrun.args), timeout_s=plan.trial_timeout_s)
        watch = Watch(trial, ev.stage, self.progress, report=not plan.objective.multi)
        sampler = Sampler(plan.nvml, plan.gpus).start()
        ev.launched = True
        try:
            # The baseline is measured in a process of its own, as a user's job would be.
            run = self.pool.run(job, fresh=ev.stage == "baseline", on_record=watch.on_record,
                                on_poll=lambda: (heartbeat.beat(), watch.tick()))
        finally:
            samples = sampler.stop()
        ev.pruned = run.stopped == "pruned"
        ev.failure, ev.message = run.failure_class, run.failure_message
        ev.attrs.update(run_attrs(run))
        if plan.util_available:
            ev.attrs.update(summarize(samples, run.steady_windows, len(plan.gpus)))
        summary = run.summary or {}
        if ev.failure is None and not ev.pruned and summary.get("loss_finite") is False:
            ev.failure, ev.message = Failure.DIVERGED, nonfinite_reason(summary)
        if ev.failure is None and not ev.pruned and summary.get("imgs_per_s") is None:
            ev.failure, ev.message = Failure.CRASH, "the job reported no throughput"


def run_attrs(run: TrialRun) -> dict[str, Any]:
    """Trial attributes from a run: figures, timing, where it ran."""
    attrs = {**measured_attrs(run.windows, run.summary), **run.timing(), "windows": len(run.windows),
             "pgids": run.pgids, "worker": run.worker, "log_path": str(run.log_path.resolve()),
             "result_path": str(run.result_path.resolve()),
             "env": {k: v for k, v in run.env.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")}}
    if run.leftover_pids:
        attrs["leftover_pids"] = run.leftover_pids
    start = run.of_kind(Kind.START)
    if run.summary is None and start:
        attrs["versions"] = start[0].get("versions")
    if run.returncode is not None:
        attrs["returncode"] = run.returncode
    if run.stopped == "pruned":
        attrs["pruned_at_window"] = len(run.windows)
    return attrs


class Watch:
    """A trial's records as they arrive: the live view, and each window reported to Optuna for the pruner."""

    def __init__(self, trial, stage: str, progress: Progress, *, report: bool):
        self.trial, self.stage, self.progress, self.report = trial, stage, progress, report
        self.windows = 0
        self.t0 = time.monotonic()

    def on_record(self, rec: dict) -> bool:
        kind = rec.get("kind")
        if kind != Kind.WINDOW:
            self.progress.phase(self.trial.number, self.stage, kind, rec)
            return False
        self.windows += 1
        ips = float(rec.get("imgs_per_s", 0.0))
        self.progress.window(self.trial.number, self.stage, self.windows, ips)
        if not self.report:
            return False
        self.trial.report(ips, step=int(rec.get("window", self.windows - 1)))
        return self.trial.should_prune()

    def tick(self) -> None:
        self.progress.tick(self.trial.number, self.stage, time.monotonic() - self.t0)
