"""`autotune export`: the chosen trial of a study as a TrainConfig YAML (plus torchrun args, env, fingerprint)."""

from __future__ import annotations

import sys

from autotune.cli import command


def arguments(p) -> None:
    p.add_argument("output", help="YAML file to write, e.g. best.yaml")
    p.add_argument("--study", help="study name (default: the only study in the storage)")
    p.add_argument("--storage", help="SQLAlchemy URL (default: sqlite:///studies/<study>.db)")
    p.add_argument("--pick", default="best",
                   help="best (default), fastest, util, balanced (pareto studies), or a trial number")


@command("export", help="write a study's best trial as a TrainConfig YAML for `autotune train`", arguments=arguments)
def run(args) -> int:
    from autotune import export, study as study_mod

    study = study_mod.load(args.study, study_mod.resolve_storage(args.study, args.storage))
    trial = export.pick_trial(study, args.pick)
    data, warnings = export.build(study, trial)
    for w in warnings:
        print(f"autotune export: warning: {w}", file=sys.stderr)
    path = export.write(data, args.output)
    m = data["autotune"]["measured"]
    gain = f", {m['gain']:.2f}x trial {m['baseline_trial']}" if m.get("gain") else ""
    print(f"autotune export: trial {trial.number} of {study.study_name} ({m['imgs_per_s']:,.1f} imgs/s{gain}) -> "
          f"{path}\n  run it: {data['autotune']['torchrun']['command'].replace('<this file>', str(path))}")
    return 0
