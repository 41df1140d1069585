"""The search: ask, evaluate, record — trial after trial, on one live worker where it can.

``search(options)`` prepares everything that can be checked first (``prepare``), opens or joins the study and its
parts study, and runs ``Engine``: before each trial the stages enqueue what they want run next (``stages``: a
measurement of a part into the parts study, an end-to-end trial into the main one); the oldest enqueued trial of
either study is asked for, else the main study's sampler draws one; ``Evaluator`` runs it; ``record`` tells the study
it belongs to. Several searches may share one study (PostgreSQL, or a journal file on a shared file system): each
runs its ``--trials`` and they never run the same trial twice.
"""

from __future__ import annotations

import dataclasses
import time

import optuna
from optuna.trial import TrialState

from autotune import verdict
from autotune.formatting import per_second
from autotune.hw.nvml import fingerprint
from autotune.runner.pool import WorkerPool
from autotune.search import script
from autotune.search.evaluate import Evaluator
from autotune.search.prepare import Plan, SearchOptions, describe_model, generate_data, prepare, summarize_data
from autotune.search.progress import Progress
from autotune.search.record import record
from autotune.search.stages import Budget, StagePlanner
from autotune.study import view
from autotune.study.found import found
from autotune.study.liveness import STALE_AFTER_S, reclaim_stale
from autotune.study.measured import ceiling_share, trainable_ceiling
from autotune.study.setup import create_or_load, parts_study
from autotune.study.storage import display_url, log_root, open_storage


def search(o: SearchOptions, say=print) -> optuna.Study:
    """Run ``o.trials`` trials of the study (creating or resuming it); returns the Optuna study."""
    plan = prepare(o, say)
    storage = open_storage(plan.storage_url)
    if plan.base is None:  # made after the storage is known to work: generating can take minutes
        base = generate_data(plan.spec, say)
        plan = dataclasses.replace(plan, base=base, probe=base, data=summarize_data(base))
    attrs = {"fingerprint": fingerprint(plan.nvml, plan.gpus), "torchrun_args": list(plan.torchrun.args)}
    logs = log_root(plan.storage_url, plan.name)
    # One pool from the first run on: a function's trial 0 starts the worker its next trials run on.
    with WorkerPool(logs / "workers") as pool:
        if plan.is_script:  # what the script applies decides the space: known from its first run, before any study
            found = script.known(storage, plan.name) or script.probe(plan, logs, say, pool=pool)
            plan = script.apply(plan, found)
            attrs.update({script.PROBE_KEY: found.record(), "unit": found.unit})
        attrs["reference_global_batch"] = reference_batch(plan)
        study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective,
                               nproc=plan.nproc, seed=o.seed, baseline=plan.baseline, starts=plan.starts, attrs=attrs)
        engine = Engine(plan, study, storage, say)
        engine.introduce()
        engine.run(pool)
    return study


MAX_RACED_ASKS = 5
"""Asks in a row that found another worker had just taken the waiting measurement (then the next one is asked)."""


class Engine:
    def __init__(self, plan: Plan, study: optuna.Study, storage, say):
        self.plan, self.study, self.storage, self.say = plan, study, storage, say
        self.parts = parts_study(study)
        self.logs = log_root(plan.storage_url, plan.name)
        self.stale_after = plan.options.stale_after_s or STALE_AFTER_S
        self.stages = StagePlanner(plan=plan, study=study, parts=self.parts)
        self.progress = Progress(total=plan.trials, timeout_s=plan.timeout_s,
                                 per=per_second(plan.script.unit if plan.script else None))
        self.t_start = time.monotonic()
        self.parts_run, self.parts_s = 0, 0.0

    def reclaim(self) -> list[str]:
        """Trials of either study whose search is gone: marked FAIL and run again (``liveness``)."""
        return [*reclaim_stale(self.study, self.storage, stale_after_s=self.stale_after),
                *reclaim_stale(self.parts, self.storage, stale_after_s=self.stale_after, prefix="p")]

    def budget(self, left: int) -> Budget:
        elapsed = time.monotonic() - self.t_start
        timeout = self.plan.timeout_s
        return Budget(trials=self.plan.trials, left=left, seconds=timeout,
                      left_s=None if timeout is None else max(0.0, timeout - elapsed), parts_run=self.parts_run,
                      parts_s=self.parts_s)

    def introduce(self) -> None:
        """What is about to happen, in a few lines: the study, the machine, the data, the model, the space."""
        plan, say = self.plan, self.say
        for line in self.reclaim():
            say(f"autotune: {line}")
        so_far = self.study.get_trials(deepcopy=False)
        n_before = len(so_far) if any(t.state != TrialState.WAITING for t in so_far) else 0
        where = f"{plan.nproc} x {'GPU ' + plan.gpus[0].name if plan.gpus else 'CPU (gloo)'}"
        state = f"resuming, {n_before} trials so far" if n_before else "new"
        say(f"autotune: study {plan.name} ({state}) in {display_url(plan.storage_url)}; {plan.trials} trial(s) on "
            f"{where}; objective {plan.objective.kind}; logs in {self.logs}/")
        if plan.data is not None:
            say(f"autotune: data: {plan.data.line()}")
        say(f"autotune: {describe_model(plan)}")
        for note in plan.space.notes:
            say(f"autotune: note: {note}")
        if not plan.util_available:
            say(f"autotune: GPU utilization unavailable ({plan.util_reason}): recorded as such, not estimated")
        say("autotune: search space: " + "; ".join(
            f"{p.path} {p.describe()}" + (f" if {p.when.path} {p.when.op} {p.when.value}" if p.when else "")
            for p in plan.space.params))
        # Trial 0 of a new study is waiting: the stages plan around it.
        waiting = len(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        say(f"autotune: {self.stages.outline(self.budget(max(0, plan.trials - waiting)))}")

    def run(self, pool: WorkerPool) -> None:
        evaluate = Evaluator(self.plan, self.study, pool, self.progress, self.logs, stages=self.stages,
                             parts=self.parts)
        launched = skipped = 0
        while launched < self.plan.trials:
            if self.plan.timeout_s is not None and time.monotonic() - self.t_start > self.plan.timeout_s:
                self.say(f"autotune: time budget of {self.plan.timeout_s:.0f} s spent; stopping")
                break
            # Another worker may have died since: its trial's parameters are then the next to run (enqueued first).
            for line in self.reclaim():
                self.progress.say(f"autotune: {line}")
            self.stages.enqueue_next(self.budget(self.plan.trials - launched))
            for line in self.stages.take_notes():
                self.progress.say(f"autotune: {line}")
            study, trial, stage = self.ask()
            try:
                ev = self.one(study, trial, stage, evaluate, counted=skipped >= self.plan.trials)
            except BaseException as e:
                abandon(study, trial, e)
                raise
            # A draw pruned before launch costs no trial of the budget (at most as many as the budget, so a sampler
            # that keeps drawing bounded settings cannot stall the search).
            if ev.skipped and skipped < self.plan.trials:
                skipped += 1
            else:
                launched += 1

    def ask(self) -> tuple[optuna.Study, optuna.Trial, view.Stage]:
        """The oldest enqueued trial of either study (the stages enqueue in the order they want things run), else a
        draw of the main study's sampler; and its stage, decided here once (``view.stage_of``) and written to the
        trial, where evaluation, the live view and every later reading of the study take it."""
        for _ in range(MAX_RACED_ASKS):
            waiting = [(t._trial_id, s) for s in (self.study, self.parts)
                       for t in s.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
            study = min(waiting, key=lambda x: x[0])[1] if waiting else self.study
            trial = study.ask()
            if study is self.study:
                return study, trial, self.staged(trial)
            if not trial.user_attrs.get("stage"):
                # Another worker took it between our look and our ask: Optuna made an empty trial of the parts study.
                why = "asked for a measurement another search worker had just taken"
            elif (twin := self.twin(trial)) is None:
                return study, trial, self.staged(trial)
            else:
                why = (f"the same measurement as trial p{twin}: two search workers planned it at once; that one "
                       "stands")
            for key, value in verdict.search_failure(why).attrs().items():
                trial.set_user_attr(key, value)
            study.tell(trial, state=TrialState.FAIL)
        trial = self.study.ask()
        return self.study, trial, self.staged(trial)

    @staticmethod
    def staged(trial: optuna.Trial) -> view.Stage:
        stage = view.stage_of(trial.user_attrs)
        if trial.user_attrs.get("stage") != stage:
            trial.set_user_attr("stage", stage)
        return stage

    def twin(self, trial: optuna.Trial) -> int | None:
        """An earlier measurement of the same part (``StagePlanner.request_key``) that runs or ran: search workers
        that plan at once may each enqueue it (a study's storage has no unique key to stop the second), and the
        later one is not run. A run again of a failed one (``retry_of``) is never a twin."""
        a = trial.user_attrs
        if a.get("retry_of") is not None:
            return None
        key = self.stages.request_key(a["stage"], a.get("overrides") or {})
        for t in self.parts.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE)):
            if t.number < trial.number and t.user_attrs.get("stage") == a["stage"] and \
                    self.stages.request_key(a["stage"], t.user_attrs.get("overrides") or {}) == key:
                return t.number
        return None

    def one(self, study: optuna.Study, trial: optuna.Trial, stage: view.Stage, evaluate: Evaluator, *,
            counted: bool = True):
        t0 = time.monotonic()
        part = study is self.parts
        label = f"p{trial.number}" if part else str(trial.number)
        a = trial.user_attrs
        if a.get("retry_of") is not None:
            why = (f"repaired: {a['repaired']} ({a.get('repair_reason')})" if a.get("repaired") else
                   "its search was gone")
            prior = f"p{a['retry_of']}" if part else a["retry_of"]
            self.progress.say(f"autotune: trial {label} re-runs the parameters of trial {prior}, {why}")
        self.progress.begin(label, stage)
        ev = evaluate(trial, stage, part=part)
        # A run made before the study existed (a script's trial 0) took its time then: its own wall stands.
        ev.wall_s = round(max(time.monotonic() - t0, ev.wall_s or 0.0), 3)
        outcome = record(study, trial, ev, self.plan.objective, self.plan.space, known_oom=evaluate.known_oom)
        if part:
            self.parts_run += 1
            self.parts_s += time.monotonic() - t0
        trials = view.views(self.study, self.parts)
        best, base = view.fastest(trials), view.baseline(trials)
        mine = next(v for v in trials if v.part == part and v.number == trial.number)
        shown = mine.shown(p.path for p in self.plan.space.params)
        self.progress.trial_done(number=label, stage=stage, params=shown, outcome=outcome, failure=ev.failure,
                                 stopped_early=ev.stopped_early is not None, ips=ev.imgs_per_s,
                                 half_width=ev.ci_half_width, util=ev.util_mean,
                                 best=(best.label, best.interval) if best else None,
                                 baseline=base.interval if base else None, wall=ev.wall_s,
                                 counted=counted or not ev.skipped)
        if ev.skipped:
            self.progress.say(f"      not launched: {ev.pruned_before_launch}")
        elif ev.stopped_early is not None:
            self.progress.say(f"      stopped early: {ev.stopped_early}")
        elif ev.failure is not None and outcome != view.Outcome.PRUNED:
            self.progress.say(f"      {ev.failure}: {ev.message} (log: {ev.log_path})")
        return ev


def abandon(study: optuna.Study, trial: optuna.Trial, exc: BaseException) -> None:
    """A trial the search could not finish (Ctrl-C, an unsafe environment, a bug) is FAIL, not left RUNNING."""
    try:  # on a trial that was already told, Optuna refuses the first call: nothing to do then
        for key, value in verdict.abandoned(exc).attrs().items():
            trial.set_user_attr(key, value)
        study.tell(trial, state=TrialState.FAIL)
    except Exception:
        pass


def reference_batch(plan: Plan) -> int:
    """The global batch the base learning rate is meant for: ``optimizer.reference_global_batch`` if the spec sets
    it, else the baseline's global batch."""
    base = plan.probe
    if base.optimizer.reference_global_batch:
        return base.optimizer.reference_global_batch
    bs = plan.baseline.get("training.batch_size", base.training.batch_size)
    acc = plan.baseline.get("training.accum_steps", base.training.accum_steps)
    return int(bs * acc * plan.world)


def best_line(study: optuna.Study) -> str:
    trials = view.views(study)
    best = view.fastest(trials)
    if best is None:
        return "autotune: no trial has completed yet; see the trial logs"
    top = trainable_ceiling(trials)
    of = ceiling_share(best.interval, top.interval) if top else None
    share = (f", {of:.0%} of the {view.devices(study)}' ceiling ({top.imgs_per_s:,.0f})" if of is not None else
             f", above the {view.devices(study)}' ceiling measured ({top.imgs_per_s:,.0f}): no bound at its settings"
             if top else "")
    return (f"autotune: fastest: {found(trials, view.rate(study), share=share)}. "
            f"`autotune show "
            f"--study {study.study_name}` lists the trials; `autotune export best.yaml --study {study.study_name}` "
            "writes its config")
