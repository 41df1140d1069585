"""`autotune search`: an Optuna study whose trials are short torchrun DDP jobs, measured in global imgs/s."""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import threading

from autotune.cli import command
from autotune.exceptions import AutotuneError, Terminated


class SearchFailed(AutotuneError):
    """The search ran, and not one end-to-end trial of the study measured a configuration."""

    exit_code = 1


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", help="study spec: a YAML path or a built-in name (resnet50, cpu-demo); default: "
                                  "resnet50 when GPUs are visible, else cpu-demo. With --script: its space, budget "
                                  "and search (space:, budget:, ...; see the README)")
    p.add_argument("--model", help="tune this model instead of the spec's: a torchvision classifier name (e.g. "
                                   "mobilenet_v3_small) or package.module:factory (called with num_classes=N)")
    p.add_argument("--data", help="tune on this ImageFolder (one sub-folder per class) instead of the spec's data")
    p.add_argument("--image-size", type=int, help="side of the square crop the model sees (default: the spec's)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"],
                   help="the trials' optimizer (default: the spec's, or the model family's reference recipe: AdamW "
                        "for ViT, Swin, MaxViT and ConvNeXt)")
    p.add_argument("--lr", type=float, help="the trials' learning rate (default: the spec's or the recipe's); a "
                                            "trial whose loss rises across its windows is void")
    p.add_argument("--trials", type=int, help="trials to run in this call (default: the spec's budget.trials)")
    p.add_argument("--timeout", type=float, help="start no trial after this many seconds")
    p.add_argument("--trial-timeout", type=float, help="end a trial with no measurement window for this long")
    p.add_argument("--storage", help="SQLAlchemy URL (default: sqlite:///studies/autotune.db, which holds every "
                                     "study; postgresql+psycopg://user:pass@host/db for many search workers) or "
                                     "journal:///path/x.journal (a shared file system); resumes the study when it "
                                     "exists")
    p.add_argument("--study", "--study-name", dest="study",
                   help="study name (default: the spec's name, with the --model and --data given)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: every selected GPU; 2 on CPU)")
    p.add_argument("--gpus", help="GPUs to use, indices into CUDA_VISIBLE_DEVICES or UUIDs, e.g. 0,1")
    p.add_argument("--objective", choices=["throughput", "pareto", "weighted"], help="default: the spec's")
    p.add_argument("--seed", type=int, help="sampler seed (default: the spec's); it makes a new study reproducible — "
                   "a resuming or joining worker derives a seed of its own from it, so it does not repeat draws")
    p.add_argument("--script", help="tune your own training script instead of the built-in job: train.py (a fresh "
                                    "torchrun per trial) or train.py:main / package.module:main (a function, trial "
                                    "after trial in one live worker); it imports trainer.runtime. Its own "
                                    "arguments go after `--`")
    p.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARGS",
                   help="after `--`: the script's own command-line arguments")
    p.add_argument("--stale-after", type=float, help="a RUNNING trial of a search on another machine whose heartbeat "
                                                     "is older than this many seconds is stale: marked FAIL and run "
                                                     "again (default 180)")


@command("search", help="tune a DDP job: an Optuna study whose trials are short torchrun runs", arguments=arguments)
def run(args: argparse.Namespace) -> int:
    from autotune.overview import image_loader_line
    from autotune.search import SearchOptions, best_line, search
    from autotune.study import view
    from autotune.verdict import FIXES
    from trainer.protocol import Failure

    options = SearchOptions(spec=args.spec, model=args.model, data=args.data, image_size=args.image_size,
                            optimizer=args.optimizer, lr=args.lr, trials=args.trials, timeout_s=args.timeout,
                            trial_timeout_s=args.trial_timeout,
                            storage=args.storage, study=args.study, nproc=args.nproc_per_node, gpus=args.gpus,
                            objective=args.objective, seed=args.seed, stale_after_s=args.stale_after,
                            script=args.script, script_args=list(args.script_args))
    # SIGTERM (a scheduler, `kill`) and SIGHUP (the terminal closed) end the search like Ctrl-C: the running trial's
    # processes are killed and the trial is recorded, instead of leaving it RUNNING for the next search to reclaim.
    old = ({s: signal.signal(s, _terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
           if threading.current_thread() is threading.main_thread() else {})
    try:
        study = search(options, say=lambda s: print(s, flush=True))
    except KeyboardInterrupt as e:
        # The live status line has no newline of its own: the message would be glued to it.
        if sys.stdout.isatty():
            print(flush=True)
        e.args = (f"{str(e) or 'interrupted'}; finished trials are kept and a running one is recorded as "
                  f"interrupted: {FIXES[Failure.INTERRUPTED]}",)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(best_line(study), flush=True)
    change = image_loader_line(view.views(study), view.rate(study))
    if change:
        print(f"autotune: {change}", flush=True)
    cause = all_failed(study)
    if cause:
        raise SearchFailed(cause)
    return 0


def all_failed(study) -> str | None:
    """Why no end-to-end trial of the study measured a configuration, when every one that ended failed (None
    otherwise): their failure classes, and the first one's message and log."""
    from autotune.study import view
    from autotune.study.view import Outcome
    from autotune.verdict import NOT_ITS_FAULT

    # A trial ended from outside (Ctrl-C, its search gone) says nothing about whether its configuration runs.
    ended = [v for v in view.views(study) if v.end_to_end
             and v.outcome in (Outcome.MEASURED, Outcome.INFEASIBLE, Outcome.FAIL)
             and v.failure_class not in NOT_ITS_FAULT]
    if not ended or any(v.feasible for v in ended):
        return None
    counts = collections.Counter(v.failure_class or "unknown" for v in ended)
    first = ended[0]
    log = first.attrs.get("log_path")
    return (f"every end-to-end trial of study {study.study_name} failed ({len(ended)}: "
            + ", ".join(f"{n} {cls}" for cls, n in counts.most_common())
            + f"); trial {first.number}: {first.failure_class or 'unknown'}: {first.failure_message or '?'}"
            + (f" (log: {log})" if log else "") + "; fix that and run the search again")


def _terminated(signum, frame):
    raise Terminated(signum)
