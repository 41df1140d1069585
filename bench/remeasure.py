"""A search's figures checked in fresh processes: its best end-to-end trial (exported as `autotune export` writes it),
the best with a CPU decode and the best with a GPU decode, each measured again in a process of its own, as the
search measured it; where the search's time went; and, with --train-s, a short `autotune train` of the best's export
(two epochs of a hard-linked view of the data, sized to last about that long at the search's pace) with its figure
and loss set against the search's and the re-measure's.

    python3 bench/remeasure.py --storage sqlite:////tmp/state/studies.db --study resnet50 --out final.json \
        --yaml best.yaml [--train-s 40 --train-images 32000 --train-dir /tmp/train-resnet50] [--deadline-s 300]

The output JSON holds the export itself (``export``) beside the figures, so a call need not bring the YAML back.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import export
from autotune.study import view
from autotune.study.storage import load, log_root
from trainer.knobs import knob

TRAIN_SLACK_S = 70.0
"""Seconds a short train run takes beyond its aimed time (start, compile from the caches, the data's scan, the
checkpoint): 54 s on 1xH200 (ResNet-50 compiled, 30 s aimed, 84 s in all, 2026-12-02); two runs were skipped
with 111-112 s left under a slack of 90."""

GPU_DECODE = knob("data.decode").gpu_values  # nvJPEG's, the hybrid, DALI
CPU_DECODE = ("pil", "torchvision-cpu")


def picks(trials: list[view.TrialView]) -> dict[str, view.TrialView]:
    """The best configuration (one run more than once at the mean of its runs: ``view.configurations``), then the
    best of each decode kind that is not already picked."""
    ok = sorted(view.configurations(trials), key=lambda v: -v.imgs_per_s)
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


def link_view(src: Path, dst: Path, copies: int) -> int:
    """``dst``: an ImageFolder holding every file of ``src`` ``copies`` times (hard links: no bytes copied), so one
    epoch lasts ``copies`` times longer; returns its file count (0 when the links cannot be made)."""
    n = 0
    try:
        for cls in sorted(d for d in src.iterdir() if d.is_dir()):
            (dst / cls.name).mkdir(parents=True, exist_ok=True)
            for f in cls.iterdir():
                for k in range(copies):
                    link = dst / cls.name / f"{k}_{f.name}"
                    if not link.exists():
                        link.hardlink_to(f)
                    n += 1
    except OSError as e:  # another file system: the run reads the folder itself, more epochs of it
        print(f"train: no linked view ({e}); the run reads {src} itself", flush=True)
        return 0
    return n


def short_train(yaml_path: str, data: dict, *, seconds: float, images: int | None, folder: str,
                timeout: float, view_dir: str | None = None) -> dict:
    """`autotune train` of the export for about ``seconds`` of training: its train-summary (imgs/s, loss) and its
    figure against the search's and against the fresh re-measure. (`autotune train`'s own ratio is to the figure the
    export says to trust, the re-measure where there is one: read as the search's, it once put 99.2 % for 100.4 %.)

    A train run's figure is its whole pace, every epoch's start included; on a benchmark set that a node reads in a
    second or two, epoch starts would be most of it (an ImageNet epoch lasts minutes). So the run reads two epochs of
    a view of the folder with each file linked as often as makes an epoch last about ``seconds`` / 2."""
    m = data["autotune"]["measured"]
    again = (m.get("remeasured") or {}).get("imgs_per_s")
    pace = float(again or m["imgs_per_s"])
    script = bool((data.get("script") or {}).get("path") or (data.get("script") or {}).get("entry"))
    script_args = list((data.get("script") or {}).get("args") or [])
    if script:  # the seed example's ImageFolder is its --data argument
        src = Path(script_args[script_args.index("--data") + 1]) if "--data" in script_args[:-1] else None
    else:
        root = Path((data.get("data") or {}).get("path") or ".")
        src = root / "train" if (root / "train").is_dir() else root
    if not images and src is not None:
        images = sum(1 for _ in src.rglob("*.jpg"))
    images = max(1, images or 1)
    copies = min(16, max(1, math.ceil(seconds / 2 * pace / images)))
    view = Path(view_dir or f"{folder}-data") / "train"
    linked = link_view(src, view, copies) if copies > 1 and src is not None and src.is_dir() else 0
    if linked:
        epochs, per_epoch = 2, linked
    else:
        epochs, per_epoch = max(2, math.ceil(seconds * pace / images)), images
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run each time: an earlier call's checkpoints would resume
    cmd = [sys.executable, "-m", "autotune", "train", "--config", yaml_path, "--out", folder, "--no-progress"]
    if script:  # the script counts its own epochs (the seed example takes --epochs; the last --data wins)
        cmd += ["--", *script_args, *(["--data", str(view)] if linked else []), "--epochs", str(epochs)]
    else:  # one checkpoint, at the end
        cmd += ["--epochs", str(epochs), "--set", f"checkpoint.every_epochs={epochs}"]
        if linked:
            cmd += ["--set", f"data.path={view.parent}"]
    print("train: " + " ".join(cmd), flush=True)
    t = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        rc, output = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out
    lines = [x for x in output.splitlines() if x.startswith("autotune train")]
    for line in lines:
        print("  " + line, flush=True)
    summary_path = Path(folder) / "train-summary.json"
    summary = json.loads(summary_path.read_text()) if rc == 0 and summary_path.exists() else None
    ips = (summary or {}).get("imgs_per_s")
    return {"epochs": epochs, "images_per_epoch": per_epoch, "copies_per_file": copies if linked else 1,
            "aimed_s": seconds, "returncode": rc, "wall_s": round(time.time() - t, 1), "imgs_per_s": ips,
            "ratio_to_search": round(ips / float(m["imgs_per_s"]), 4) if ips and m.get("imgs_per_s") else None,
            "ratio_to_remeasure": round(ips / again, 4) if ips and again else None,
            "loss_start": (summary or {}).get("loss_start"), "loss_end": (summary or {}).get("loss_end"),
            "loss_finite": (summary or {}).get("loss_finite"), "summary": summary, "lines": lines,
            "output_tail": output.splitlines()[-25:] if rc != 0 else []}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--storage", required=True)
    p.add_argument("--study")
    p.add_argument("--out", required=True)
    p.add_argument("--yaml", required=True, help="where the best trial's export goes")
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--roles", default="best,cpu-decode,gpu-decode", help="which picks to re-measure (default: all)")
    p.add_argument("--train-s", type=float, default=0,
                   help="then `autotune train` the best's export for about this many seconds (0: no train run)")
    p.add_argument("--train-images", type=int, help="training images per epoch (default: counted in data.path)")
    p.add_argument("--train-dir", help="the train run's folder (default: beside the study's trials)")
    p.add_argument("--train-view", help="where the linked view of the data goes (default: beside --train-dir)")
    p.add_argument("--deadline-s", type=float,
                   help="seconds this may take: no re-measure starts with less than 60 s left, no train run with "
                        f"less than --train-s + {TRAIN_SLACK_S:.0f}")
    args = p.parse_args()
    began = time.time()

    def left() -> float:
        return math.inf if args.deadline_s is None else args.deadline_s - (time.time() - began)

    study = load(args.study, args.storage)
    trials = view.views(study)
    results = {"study": study.study_name, "time": time_spent(trials), "remeasured": [], "skipped": []}
    roles = args.roles.split(",")
    for role, v in picks(trials).items():
        if role not in roles:
            continue
        if left() < 60:
            results["skipped"].append(f"{role} (trial {v.number}): not re-measured, {left():.0f} s left")
            print(results["skipped"][-1], flush=True)
            continue
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
            results["export"] = data
    if args.train_s and "export" in results:
        if left() < args.train_s + TRAIN_SLACK_S:
            results["skipped"].append(f"train: not run, {left():.0f} s left")
            print(results["skipped"][-1], flush=True)
        else:
            folder = args.train_dir or str(log_root(args.storage, study.study_name) / "train-best")
            results["train"] = short_train(args.yaml, results["export"], seconds=args.train_s,
                                           images=args.train_images, folder=folder, view_dir=args.train_view,
                                           timeout=max(60.0, min(left() - 10, args.train_s * 4 + 120)))
            t = results["train"]
            print(f"train of the export ({t['epochs']} epochs): "
                  + (f"{t['imgs_per_s']:,.1f} imgs/s = {t['ratio_to_search']:.1%} of the search's figure"
                     if t["imgs_per_s"] and t["ratio_to_search"] else f"no figure (exit {t['returncode']})")
                  + (f", {t['ratio_to_remeasure']:.1%} of the re-measure" if t["ratio_to_remeasure"] else "")
                  + f"; loss {t['loss_start']} -> {t['loss_end']}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results["time"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
