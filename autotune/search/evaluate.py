"""Evaluate one trial: its configuration (drawn by the sampler, or set by a stage), the checks that make a launch
pointless (an invalid combination, an OOM already seen, a bound the stages measured below the best), the run on a
live worker with the GPUs sampled, and what it measured as trial attributes.

Which worker: trial 0 runs in a fresh process, as a user's job would. On a GPU, a run whose cuDNN plans a live worker
would hand it second-hand gets a fresh one: a measurement the cuDNN decision stands on, when its shapes already ran in
the live worker (cuDNN's plan cache is keyed without the search flag: the second run would reuse the first's plans),
and a run with the search on, when its shapes first ran there with it off (it would run on the heuristics' plans).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune import verdict
from autotune.hw.cpu import CpuSampler, busy_share
from autotune.hw.nvml import Sampler, summarize
from autotune.objective import measured_attrs
from autotune.runner.pool import WorkerPool
from autotune.runner.trial import Stopped, TrialJob, TrialRun
from autotune.search.compile_cache import compile_cache
from autotune.search.progress import Progress
from autotune.space import predicted_oom
from autotune.study.liveness import Heartbeat, owner
from autotune.study.pruning import LIVE_INTERVAL, best_feasible
from autotune.study.storage import record_on_trial, set_trial_attrs
from autotune.study.view import Outcome, Stage, views
from trainer.config import ConfigError, TrainConfig
from trainer.estimate import Interval
from trainer.protocol import Failure, Kind, StrEnum

BASELINE_CAP = 1.5
"""Trial 0 may measure this many times the seconds of other trials (``measure.max_s``) before its interval stands as
it is: it is input-bound and noisy, every gain the search reports is a ratio to it, and measuring it longer costs less
than measuring it again in a fresh process."""

BASELINE_PRECISION = 0.05
"""Trial 0 measures until its interval is within this (or the study's own precision, if looser): it is the input-bound
seed configuration, noisy window to window and process to process, and a ratio to it carries its interval either
way; measuring it as tightly as a candidate costs a search a fifth of its budget."""


def baseline_precision(measure) -> float:
    """The precision trial 0 measures to (``BASELINE_PRECISION``, or the study's ``measure.precision`` if looser):
    one rule for the built-in job, a user's script and a framework's."""
    return max(measure.precision, BASELINE_PRECISION)


def baseline_measure(measure) -> dict[str, Any]:
    """The measurement overrides trial 0 runs with, wherever it runs (the search's baseline trial, a script's first
    run before the study exists, its re-measure): its longer cap and its precision."""
    return {"measure.max_s": BASELINE_CAP * measure.max_s, "measure.precision": baseline_precision(measure)}


TRIAL_0 = "trial 0 runs as a user's job does"
"""Why trial 0 gets a process of its own (``TrialRun.fresh``, shown in its row)."""

TRIAL_0_AGAIN = "trial 0 measured again, from a new process's start"
"""Why its re-measure does: a second process's figure, where one process's stayed unsure."""


BOUNDED_STAGES = frozenset({Stage.CANDIDATE, Stage.CLIMB, Stage.REFINE, Stage.SEARCH, Stage.RETRY})
"""End-to-end trials not launched when what the stages measured bounds them below the best (not the baseline, and
not a start the spec asked for)."""


class Stop(StrEnum):
    """Why the search stops a run before it ends by itself (``Watch.stopped``; the sentence a person reads is
    ``Watch.why``)."""

    PRUNED = "pruned"
    """The pruner: its running interval lies below the best's."""

    ABOVE = "above"
    """A supply whose interval lies above ``stop_when``'s ``above``: it feeds more than the model can take."""

    OUT_OF_REACH = "out_of_reach"
    """A supply whose interval lies below ``stop_when``'s ``below``: out of reach of the best."""


@dataclass(kw_only=True)
class Evaluation:
    """What a trial's evaluation found, the one record of its result from the evaluation to the study: how it ended
    (``failure``, ``pruned``) and what it measured, as named fields; ``attrs`` writes it as the trial's attrs (the
    keys the study has always stored them under, so every study reads the same)."""

    stage: Stage
    config: TrainConfig | None = None
    failure: Failure | None = None
    message: str | None = None
    pruned: bool = False
    skipped: bool = False
    """Pruned before launch: a bound the stages measured is below the best (costs no trial of the budget)."""

    launched: bool = False

    log_path: str | None = None
    imgs_per_s: float | None = None
    ci_half_width: float | None = None
    precise: bool | None = None
    util_available: bool = False
    util_mean: float | None = None
    """Stored even when None: no sample fell in the windows."""

    wall_s: float | None = None
    """The trial's wall time (asked for → told); a run made before the study existed gives its own."""

    stopped_early: str | None = None
    """Why a measurement of a part stopped before its interval was tight (``Watch.why``)."""

    pruned_before_launch: str | None = None
    bound_imgs_per_s: float | None = None
    """The measured bound a draw pruned before launch lay under (``Evaluator.bounded``)."""

    oom_predicted_from: int | str | None = None
    """The trial whose OOM predicted this one's (``Evaluator.known_oom``)."""

    shapes_new_to_worker: bool | None = None
    loss_warning: str | None = None
    """What makes its figure doubtful though it stands (``autotune.verdict.still_loss``; ``formatting.LOSS_WARNING``
    reads it)."""

    repaired_by_next: dict[str, Any] | None = None
    """What the repaired draw enqueued after it changes (``autotune.search.record``)."""

    figures: dict[str, Any] = field(default_factory=dict)
    """The rest of what the run recorded, stored as it is: its summary's figures, its timing, where it ran, the
    GPUs' samples (nothing in the search reads them by name)."""

    def __post_init__(self):
        self.stage = Stage(self.stage)  # the stored attr's plain string reads as its Stage

    def judged(self, v: verdict.Verdict) -> None:
        """Take ``autotune.verdict``'s decision as the trial's failure and message."""
        self.failure, self.message, self.loss_warning = v.failure, v.reason, v.warning

    def take(self, measured: dict[str, Any]) -> None:
        """Take what a run or the GPUs' samples recorded: a named field by its name, the rest into ``figures``."""
        for key, value in measured.items():
            if key in _NAMED:
                setattr(self, key, value)
            else:
                self.figures[key] = value

    @property
    def outcome(self) -> Outcome:
        """How the trial ends, as the study is told."""
        return Outcome.ended(self.failure, pruned=self.pruned, part=self.stage.measures_part)

    def attrs(self) -> dict[str, Any]:
        """The trial's attrs as the study stores them (``autotune.study.storage.set_trial_attrs``): each field by its
        name, those that are None left out (but ``util_mean``)."""
        named = {f: getattr(self, f) for f in _NAMED}
        if self.failure is not None and not self.pruned:
            named.update(failure_class=str(self.failure), failure_message=self.message)
        return {k: v for k, v in {**self.figures, **named}.items() if v is not None or k == "util_mean"}


_NAMED = ("stage", "log_path", "imgs_per_s", "ci_half_width", "precise", "util_available", "util_mean", "wall_s",
          "stopped_early", "pruned_before_launch", "bound_imgs_per_s", "oom_predicted_from", "shapes_new_to_worker",
          "loss_warning", "repaired_by_next")
"""The fields of ``Evaluation`` stored as the trial's attrs, under their own names."""


class Evaluator:
    """Runs trials for one search: the plan, the study and its parts study (for what earlier trials learned), the
    stage planner (its decisions and bounds) and a pool of workers."""

    def __init__(self, plan, study, pool: WorkerPool, progress: Progress, logs: Path, *, stages=None, parts=None):
        self.plan, self.study, self.pool, self.progress, self.logs = plan, study, pool, progress, logs
        self.stages, self.parts = stages, parts
        self.me = owner()
        self.preloaded = dict(plan.preloaded)
        """Runs made before the study existed, by stage, until the trial of that stage takes its run."""
        self.seen: dict[str, dict[tuple, bool]] = {}
        """Per live worker: the convolution shapes it ran, and whether cuDNN's search was on when they first ran."""

    def __call__(self, trial, stage: Stage, *, part: bool = False) -> Evaluation:
        """Evaluate ``trial``, asked for as ``stage`` (``autotune.search.engine.Engine.ask`` decides it)."""
        set_trial_attrs(trial, self.me)
        heartbeat = Heartbeat(trial)
        heartbeat.beat(force=True)
        trial_dir = self.logs / (f"part-{trial.number}" if part else f"trial-{trial.number}")
        ev = Evaluation(stage=stage, log_path=str((trial_dir / "log.txt").resolve()),
                        util_available=self.plan.util_available)
        overrides = self.plan.space.settle(self.overrides(trial, stage), self.plan.base.to_dict())
        try:
            name = f"{self.plan.name}-{'part' if part else 'trial'}-{trial.number}"
            ev.config = self.plan.base.with_overrides({**overrides, "name": name, "output_dir": str(trial_dir)})
            if ev.config.training.compile and ev.config.training.compile_cache_dir is None:
                # The machine's compile cache (``compile_cache``): a fresh worker, the next search, the export's
                # re-measure and a train run load what an earlier process compiled, and no other job on the machine
                # shares torch's default folder.
                ev.config = ev.config.with_overrides(
                    {"training.compile_cache_dir": str(compile_cache(ev.config).resolve())})
            cudnn = self.stages.cudnn_for(ev.config.to_dict()) if self.stages is not None else None
            if cudnn is not None and "training.cudnn_benchmark" not in overrides:
                ev.config = ev.config.with_overrides({"training.cudnn_benchmark": cudnn})
            if trial.user_attrs.get("profile_steps"):  # the profile stage's run: its step profiled after its windows
                ev.config = ev.config.with_overrides({"measure.profile_steps": int(trial.user_attrs["profile_steps"])})
        except ConfigError as e:
            ev.judged(verdict.invalid(e.problems))
            return ev
        prior = self.known_oom(ev.config.to_dict())
        if prior is not None:
            ev.judged(verdict.predicted_oom(prior))
            ev.oom_predicted_from = prior
            return ev
        if self.bounded(ev):
            return ev
        self.launch(trial, ev, trial_dir, heartbeat)
        return ev

    def overrides(self, trial, stage: Stage) -> dict[str, Any]:
        if stage.measures_part:
            return dict(trial.user_attrs.get("overrides") or {})
        if stage == Stage.BASELINE:
            # Trial 0 and its re-measure run the baseline's params and the base for the rest (a script's own
            # values the space does not hold): the sampler draws nothing for them.
            overrides = self.plan.space.suggest(trial, self.plan.base.to_dict(), only=set(self.plan.baseline))
            if stage not in self.preloaded:  # a run made before the study existed has its measurement
                overrides.update(baseline_measure(self.plan.base.measure))
            return overrides
        return self.plan.space.suggest(trial, self.plan.base.to_dict())

    def known_oom(self, config: dict[str, Any]) -> int | str | None:
        """The trial that already ran out of memory at a batch <= this config's with the same memory-relevant
        settings (its number, ``p<N>`` for a measurement of a part; None: none did)."""
        ooms = [(v.label if v.part else v.number, v.config) for v in views(self.study, self.parts)
                if v.failure_class == Failure.OOM and v.config and not v.attrs.get("oom_predicted_from")]
        return predicted_oom(config, ooms)

    def bounded(self, ev: Evaluation) -> bool:
        """Prune before launch a draw whose measured bound (the top of its ceiling's or its supply's interval) lies
        below the best's interval: it cannot win, and its windows would only be spent finding that out."""
        if (self.stages is None or ev.stage not in BOUNDED_STAGES or self.plan.objective.multi
                or self.plan.spec.pruner.kind == "none"):
            return False
        bound = self.stages.bound(ev.config.to_dict())
        best = best_feasible(self.study)
        if bound is None or best is None or bound[0] >= best.low:
            return False
        ev.pruned = ev.skipped = True
        ev.bound_imgs_per_s = round(bound[0], 3)
        ev.pruned_before_launch = f"{bound[1]}, below the best ({best.low:,.0f} at the least); not launched"
        return True

    def fresh(self, ev: Evaluation, trial) -> str | None:
        """Why the trial needs a worker of its own, in words (see the module's docstring); None: it does not."""
        if ev.stage == Stage.BASELINE:
            return TRIAL_0_AGAIN if trial.user_attrs.get("remeasure_of") is not None else TRIAL_0
        shape = conv_shape(ev.config)
        live = self.pool.worker.name if self.pool.worker is not None and self.pool.worker.alive() else None
        if not self.plan.entries or shape is None or live is None:
            return None
        seen = self.seen.get(live, {})
        if trial.user_attrs.get("cudnn_evidence") and shape in seen:
            return "training.cudnn_benchmark off on shapes its worker ran: a process keeps cuDNN's plans"
        if ev.config.training.cudnn_benchmark and seen.get(shape) is False:
            return "training.cudnn_benchmark on for shapes its worker ran with it off: a process keeps cuDNN's plans"
        return None

    def launch(self, trial, ev: Evaluation, trial_dir: Path, heartbeat: Heartbeat) -> None:
        plan = self.plan
        job = TrialJob(config=ev.config, trial_dir=trial_dir, nproc_per_node=plan.nproc,
                       gpus=[g.uuid for g in plan.gpus] if plan.gpus else plan.entries,
                       torchrun_args=list(plan.torchrun.args), timeout_s=plan.trial_timeout_s)
        watch = Watch(trial, ev.stage, self.progress, report=not plan.objective.multi,
                      stop_when=trial.user_attrs.get("stop_when"))
        ev.launched = True
        if ev.stage in self.preloaded:  # already run before the study existed (a user's script's first run)
            run, samples = self.preloaded.pop(ev.stage)
            readings = []
        else:
            fresh = self.fresh(ev, trial)
            sampler, cpu = Sampler(plan.nvml, plan.gpus).start(), CpuSampler().start()
            try:
                run = self.pool.run(job, fresh=fresh, on_record=watch.on_record,
                                    on_poll=lambda: (heartbeat.beat(), watch.tick()))
            finally:
                samples, readings = sampler.stop(), cpu.stop()
        shape = conv_shape(ev.config)
        if run.worker is not None and shape is not None:
            ran = self.seen.setdefault(run.worker, {})
            ev.shapes_new_to_worker = shape not in ran
            ran.setdefault(shape, ev.config.training.cudnn_benchmark)
        ev.pruned = run.stopped == Stopped.PRUNED and watch.stopped == Stop.PRUNED
        early = watch.stopped is not None and not ev.pruned
        ev.judged(verdict.judge(run, pruned=ev.pruned, stopped_early=early))
        ev.take(run_attrs(run))
        if watch.stopped == Stop.PRUNED:
            # The figure a pruned trial shows is the one Optuna stores: its last report, the estimate whose interval
            # lay below the best's.
            ev.imgs_per_s, ev.ci_half_width, ev.precise = watch.latest.value, round(watch.latest.half_width, 5), False
        elif watch.stopped is not None:
            ev.stopped_early = watch.why
            if run.summary is None and watch.latest is not None:
                # Ended at once (a script's own process): the figure is the estimate the stop was decided on.
                ev.imgs_per_s, ev.ci_half_width = watch.latest.value, round(watch.latest.half_width, 5)
                ev.precise = False
        if plan.util_available:
            ev.take(summarize(samples, run.steady_windows, len(plan.gpus)))
        busy = busy_share(readings, run.steady_windows)
        if busy is not None:
            ev.take({"cpu_busy": busy})


def conv_shape(config: TrainConfig) -> tuple | None:
    """What cuDNN keys its plans by, as far as a config decides it (None: a run without a model)."""
    if config.training.supply:
        return None
    return (config.model.name, repr(config.model.kwargs), config.data.image_size, config.training.precision,
            config.training.channels_last, config.training.batch_size)


def run_attrs(run: TrialRun) -> dict[str, Any]:
    """Trial attributes from a run: figures, timing, where it ran."""
    attrs = {**measured_attrs(run.windows, run.summary), **run.timing(), "windows": len(run.windows),
             "pgids": run.pgids, "worker": run.worker, "fresh_process": run.fresh,
             "log_path": str(run.log_path.resolve()),
             "result_path": str(run.result_path.resolve()),
             "env": {k: v for k, v in run.env.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")}}
    if run.leftover_pids:
        attrs["leftover_pids"] = run.leftover_pids
    if any(r.get("loader_kept") for r in run.of_kind(Kind.SETTINGS)):
        attrs["loader_kept"] = True  # its loader's workers were an earlier trial's (trainer.runtime.kept)
    start = run.of_kind(Kind.START)
    if run.summary is None and start:
        attrs["versions"] = start[0].get("versions")
    if run.returncode is not None:
        attrs["returncode"] = run.returncode
    if run.stopped == Stopped.PRUNED:
        attrs["pruned_at_window"] = len(run.windows)
    return attrs


class Watch:
    """A trial's records as they arrive: the live view; for an end-to-end trial, each window's running estimate
    reported to Optuna for the pruner (``autotune.study.pruning``); for a supply, its early stop (``stop_when``)."""

    def __init__(self, trial, stage: Stage, progress: Progress, *, report: bool,
                 stop_when: dict[str, Any] | None = None):
        self.trial, self.stage, self.progress, self.report = trial, stage, progress, report
        self.stop_when = stop_when
        self.windows = 0
        self.latest: Interval | None = None
        """The running estimate and its interval after the latest window that had one."""

        self.stopped: Stop | None = None
        """Why the run is to stop (None: it is not)."""

        self.why: str | None = None
        """That reason as a person reads it, for a supply's early stop (``why_supply_stops``)."""

        self.t0 = time.monotonic()

    def on_record(self, rec: dict) -> bool:
        kind = rec.get("kind")
        if kind != Kind.WINDOW:
            self.progress.phase(self.trial.number, self.stage, kind, rec)
            return False
        self.windows += 1
        est = rec.get("estimate")
        if est and not self.stopped:  # after the decision, the figure stays the one it was decided on
            self.latest = Interval(float(est["imgs_per_s"]), float(est["half_width"]))
        shown = self.latest or Interval(float(rec.get("imgs_per_s", 0.0)), 0.0)
        self.progress.window(self.trial.number, self.stage, self.windows, shown.value,
                             self.latest.half_width if est else None)
        if self.stopped or not est:
            return False  # after the decision, the window the job finishes on is not judged
        if self.stop_when:
            self.stopped = supply_stop(self.latest, self.stop_when)
            self.why = why_supply_stops(self.latest, self.stop_when, per=self.progress.per)
            return self.stopped is not None
        if not self.report or self.stage.measures_part:
            return False
        record_on_trial(self.trial, LIVE_INTERVAL, [self.latest.value, self.latest.half_width])  # the pruner's
        self.trial.report(self.latest.value, step=int(rec.get("window", self.windows - 1)))
        if self.trial.should_prune():
            self.stopped = Stop.PRUNED
        return self.stopped is not None

    def tick(self) -> None:
        self.progress.tick(self.trial.number, self.stage, time.monotonic() - self.t0)


def supply_stop(est: Interval, stop_when: dict[str, Any]) -> Stop | None:
    """Whether a supply measurement may stop before its interval is tight, and why (None: it may not): its interval
    lies above ``above`` (it feeds more than the model can take) or below ``below`` (out of reach of the best)."""
    if stop_when.get("above") is not None and est.low > stop_when["above"]:
        return Stop.ABOVE
    if stop_when.get("below") is not None and est.high < stop_when["below"]:
        return Stop.OUT_OF_REACH
    return None


def why_supply_stops(est: Interval, stop_when: dict[str, Any], *, per: str = "imgs/s") -> str | None:
    """``supply_stop``'s reason as a person reads it, or None; ``per``: the job's rate label
    (``autotune.formatting.per_second``)."""
    stop = supply_stop(est, stop_when)
    if stop == Stop.ABOVE:
        return f"above the ceiling ({stop_when['above']:,.0f} {per}): {est.low:,.0f} at the least"
    if stop == Stop.OUT_OF_REACH:
        return f"out of reach ({stop_when['below']:,.0f} {per}): {est.high:,.0f} at the most"
    return None
