"""The search: ask, evaluate, record — trial after trial, on one live worker where it can.

``search(options)`` prepares everything that can be checked first (``prepare``), opens or joins the study, and runs
``Engine``: before each trial the stages enqueue what they want measured next (``stages``); Optuna's ask hands out
what is enqueued, else what its sampler draws; ``Evaluator`` runs it; ``record`` tells the study. Several searches
may share one study (PostgreSQL, or a journal file on a shared file system): each runs its ``--trials`` and they never
run the same trial twice.
"""

from __future__ import annotations

import time

import optuna
from optuna.trial import TrialState

from autotune.hw.nvml import fingerprint
from autotune.runner.pool import WorkerPool
from autotune.search.evaluate import Evaluator
from autotune.search.prepare import Plan, SearchOptions, describe_model, generate_data, prepare, summarize_data
from autotune.search.progress import Progress
from autotune.search.record import record
from autotune.search.stages import StagePlanner, shown_settings
from autotune.study import view
from autotune.study.liveness import STALE_AFTER_S, reclaim_stale
from autotune.study.setup import create_or_load
from autotune.study.storage import display_url, log_root, open_storage
from trainer.protocol import Failure


def search(o: SearchOptions, say=print) -> optuna.Study:
    """Run ``o.trials`` trials of the study (creating or resuming it); returns the Optuna study."""
    plan = prepare(o, say)
    storage = open_storage(plan.storage_url)
    if plan.base is None:  # made after the storage is known to work: generating can take minutes
        plan.base = generate_data(plan.spec, say)
        plan.probe, plan.data = plan.base, summarize_data(plan.base)
    study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective,
                           nproc=plan.nproc, seed=o.seed, baseline=plan.baseline, starts=plan.starts,
                           attrs={"fingerprint": fingerprint(plan.nvml, plan.gpus),
                                  "torchrun_args": list(plan.torchrun.args),
                                  "reference_global_batch": reference_batch(plan)})
    engine = Engine(plan, study, storage, say)
    engine.introduce()
    with WorkerPool(engine.logs / "workers") as pool:
        engine.run(pool)
    return study


class Engine:
    def __init__(self, plan: Plan, study: optuna.Study, storage, say):
        self.plan, self.study, self.storage, self.say = plan, study, storage, say
        self.logs = log_root(plan.storage_url, plan.name)
        self.stale_after = plan.options.stale_after_s or STALE_AFTER_S
        self.stages = StagePlanner(plan, study)
        self.progress = Progress(total=plan.trials, timeout_s=plan.timeout_s)

    def introduce(self) -> None:
        """What is about to happen, in a few lines: the study, the machine, the data, the model, the space."""
        plan, say = self.plan, self.say
        for line in reclaim_stale(self.study, self.storage, stale_after_s=self.stale_after):
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
        if plan.spec.stages.enabled:
            say("autotune: stages: the model alone (ceiling), each input pipeline alone (supply), then end to end "
                "where the supply meets the ceiling; the sampler refines from there")

    def run(self, pool: WorkerPool) -> None:
        evaluate = Evaluator(self.plan, self.study, pool, self.progress, self.logs)
        t_start = time.monotonic()
        for done in range(self.plan.trials):
            if self.plan.timeout_s is not None and time.monotonic() - t_start > self.plan.timeout_s:
                self.say(f"autotune: time budget of {self.plan.timeout_s:.0f} s spent; stopping")
                break
            # Another worker may have died since: its trial's parameters are then the next to run (enqueued first).
            for line in reclaim_stale(self.study, self.storage, stale_after_s=self.stale_after):
                self.progress.say(f"autotune: {line}")
            self.stages.enqueue_next(left=self.plan.trials - done)
            trial = self.study.ask()
            try:
                self.one(trial, evaluate)
            except BaseException as e:
                abandon(self.study, trial, e)
                raise

    def one(self, trial: optuna.Trial, evaluate: Evaluator) -> None:
        t0 = time.monotonic()
        stage = trial.user_attrs.get("stage") or "search"
        a = trial.user_attrs
        if a.get("retry_of") is not None:
            why = (f"repaired: {a['repaired']} ({a.get('repair_reason')})" if a.get("repaired") else
                   "its search was gone")
            self.progress.say(f"autotune: trial {trial.number} re-runs the parameters of trial {a['retry_of']}, {why}")
        self.progress.begin(trial.number, stage)
        ev = evaluate(trial, self.stages.decided())
        ev.attrs["wall_s"] = round(time.monotonic() - t0, 3)
        state = record(self.study, trial, ev, self.plan.objective, self.plan.space, known_oom=evaluate.known_oom)
        trials = view.views(self.study)
        best, base = view.fastest(trials), view.baseline(trials)
        outcome = {"complete": "ok" if stage not in view.MEASUREMENT_STAGES else "measured", "pruned": "pruned",
                   "infeasible": f"infeasible:{ev.failure}", "fail": f"FAIL:{ev.failure}"}[state]
        shown = dict(trial.params) or shown_settings(trial.user_attrs.get("overrides") or {})
        self.progress.trial_done(number=trial.number, stage=stage, params=shown, outcome=outcome,
                                 ips=ev.attrs.get("imgs_per_s"), util=ev.attrs.get("util_mean"),
                                 best=(best.number, best.imgs_per_s) if best else None,
                                 baseline=base.imgs_per_s if base else None, wall=time.monotonic() - t0)
        if ev.failure is not None and state != "pruned":
            self.progress.say(f"      {ev.failure}: {ev.message} (log: {ev.attrs.get('log_path')})")


def abandon(study: optuna.Study, trial: optuna.Trial, exc: BaseException) -> None:
    """A trial the search could not finish (Ctrl-C, an unsafe environment, a bug) is FAIL, not left RUNNING."""
    try:  # on a trial that was already told, Optuna refuses the first call: nothing to do then
        interrupted = isinstance(exc, KeyboardInterrupt)
        trial.set_user_attr("failure_class", str(Failure.INTERRUPTED if interrupted else Failure.SEARCH))
        trial.set_user_attr("failure_message", (str(exc) or "interrupted (Ctrl-C)") if interrupted else
                            f"{type(exc).__name__}: {exc}"[:300])
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
    best, base = view.fastest(trials), view.baseline(trials)
    if best is None:
        return "autotune: no trial has completed yet; see the trial logs"
    gain = f", {best.imgs_per_s / base.imgs_per_s:.2f}x the baseline (trial 0: {base.imgs_per_s:,.1f})" if base else ""
    top = view.ceiling(trials)
    share = (f", {best.imgs_per_s / top.imgs_per_s:.0%} of the {view.devices(study)}' ceiling "
             f"({top.imgs_per_s:,.0f})") if top else ""
    return (f"autotune: fastest: trial {best.number} at {best.imgs_per_s:,.1f} imgs/s{gain}{share}. `autotune show "
            f"--study {study.study_name}` lists the trials; `autotune export best.yaml --study {study.study_name}` "
            "writes its config")
