"""A search's figures checked in fresh processes: its best end-to-end trial (exported as `autotune export` writes it),
the best with a CPU decode and the best with a GPU decode, each measured again in a process of its own, as the
search measured it; plus where the search's time went.

    python3 bench/remeasure.py --storage sqlite:////tmp/state/resnet50.db --out final.json --yaml best.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import export
from autotune.study import view
from autotune.study.storage import load, log_root

CPU_DECODE = ("pil", "torchvision-cpu")
GPU_DECODE = ("nvjpeg-gpu", "nvjpeg-hw", "hybrid")


def picks(trials: list[view.TrialView]) -> dict[str, view.TrialView]:
    """The best end-to-end trial, then the best of each decode kind that is not already picked."""
    ok = sorted(view.feasible(trials), key=lambda v: -v.imgs_per_s)
    chosen: dict[str, view.TrialView] = {}
    if ok:
        chosen["best"] = ok[0]
    for name, decodes in (("cpu-decode", CPU_DECODE), ("gpu-decode", GPU_DECODE)):
        taken = {v.number for v in chosen.values()}
        found = next((v for v in ok if v.setting("data.decode") in decodes and v.number not in taken), None)
        if found is not None:
            chosen[name] = found
    return chosen


def time_spent(trials: list[view.TrialView]) -> dict:
    ran = [v for v in trials if v.attrs.get("wall_s") is not None]
    walls = [float(v.attrs["wall_s"]) for v in ran]
    stages: dict[str, int] = {}
    for v in trials:
        stages[v.stage] = stages.get(v.stage, 0) + 1
    return {"trials": len(trials), "by_stage": stages, "median_trial_s": statistics.median(walls) if walls else None,
            "sum_trial_s": round(sum(walls), 1),
            "first_16_best": max((v.imgs_per_s for v in view.feasible(trials) if v.number < 16), default=None)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--storage", required=True)
    p.add_argument("--study")
    p.add_argument("--out", required=True)
    p.add_argument("--yaml", required=True, help="where the best trial's export goes")
    p.add_argument("--timeout", type=float, default=150)
    args = p.parse_args()
    study = load(args.study, args.storage)
    trials = view.views(study)
    results = {"study": study.study_name, "time": time_spent(trials), "remeasured": []}
    for role, v in picks(trials).items():
        data, _ = export.build(study, v)
        folder = log_root(args.storage, study.study_name) / f"remeasure-{role}-trial-{v.number}"
        line = export.remeasure(study, v, data, folder, timeout_s=args.timeout)
        again = data["autotune"]["measured"].get("remeasured") or {}
        results["remeasured"].append({"role": role, "trial": v.number, "decode": v.setting("data.decode"),
                                      "precision": v.setting("training.precision"), "searched": v.imgs_per_s,
                                      "worker": v.attrs.get("worker"), "launch_s": v.attrs.get("launch_s"),
                                      **again, "line": line})
        print(f"{role} (trial {v.number}): {line}", flush=True)
        if role == "best":
            export.write(data, args.yaml)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results["time"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
