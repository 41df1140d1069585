"""`autotune export`: the chosen trial of a study as a TrainConfig YAML (plus torchrun args, env, fingerprint),
re-measured in a fresh process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autotune.cli import command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="YAML file to write, e.g. best.yaml")
    p.add_argument("--study", help="study name (default: the only study in the storage)")
    p.add_argument("--storage", help="SQLAlchemy URL (default: the file under studies/ that holds the study)")
    p.add_argument("--pick", default="best",
                   help="best (default), fastest, util, balanced (pareto studies), or a trial number")
    p.add_argument("--no-remeasure", action="store_true",
                   help="write the file without measuring the trial again in a fresh process")


@command("export", help="write a study's best trial as a TrainConfig YAML for `autotune train`, re-measured in a "
                        "fresh process", arguments=arguments)
def run(args: argparse.Namespace) -> int:
    from autotune import export
    from autotune.formatting import fmt_ips
    from autotune.outputs import check_output
    from autotune.study.storage import load, log_root, resolve_storage

    url = resolve_storage(args.study, args.storage)
    study = load(args.study, url)
    trial = export.pick_trial(study, args.pick)
    data, warnings = export.build(study, trial)
    made = check_output(args.output, "output")  # before the re-measure: a path that cannot be written costs nothing
    if made is not None:
        print(f"autotune export: making folder {made}", flush=True)
    for w in warnings:
        print(f"autotune export: warning: {w}", file=sys.stderr)
    m = data["autotune"]["measured"]
    gain = f", {m['gain']:.2f}x trial {m['baseline_trial']}" if m.get("gain") else ""
    print(f"autotune export: trial {trial.number} of {study.study_name} ({fmt_ips(m['imgs_per_s'])} "
          f"{m.get('per', 'imgs/s')}{gain})", flush=True)
    if not args.no_remeasure:
        folder = log_root(url, study.study_name) / f"remeasure-trial-{trial.number}"
        print(f"autotune export: {export.remeasure(study, trial, data, Path(folder))}", flush=True)
        below = export.below_baseline_warning(trial, data)
        if below:
            print(f"autotune export: warning: {below}", file=sys.stderr, flush=True)
    path = export.write(data, args.output)
    print(f"autotune export: -> {path}\n  run it: "
          f"{data['autotune']['torchrun']['command'].replace('<this file>', str(path))}")
    return 0
