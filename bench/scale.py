"""One config on one GPU and on N GPUs, side by side: scaling efficiency = N-GPU imgs/s / (N x one-GPU imgs/s).

    python3 bench/scale.py --out scale.json --config best.yaml            # an `autotune export` (measure mode)
    python3 bench/scale.py --out scale.json --study resnet50 --storage sqlite:////tmp/state/studies.db \
        [--or-row ddp-base]                                                # the row when there is no such study
    python3 bench/scale.py --out scale.json --row e2e-hybrid-50 --data /tmp/jpegs --set data.num_classes=100

The same config per rank both times (batch, accumulation, workers, decode: what a rank does is unchanged; only the
world grows), each a fresh `torchrun` through bench/run.py's run_one (the trial launcher, NVML on exactly the run's
GPUs, only samples inside its windows). --study takes the study's fastest feasible end-to-end trial as `autotune
export` builds it, without a re-measure. A figure stands only with a finite loss that did not rise; the efficiency is
given only when both stand. N: every visible GPU (2 gloo ranks without GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from run import PLAN, fmt_loss, row_config, run_one

from autotune.hw import nvml as nvml_gpu
from autotune.hw.placement import visible_entries
from trainer.config import TrainConfig


def from_study(study_name: str, storage: str, folder: Path) -> tuple[TrainConfig, dict]:
    """The study's fastest feasible end-to-end trial, exported (no re-measure); and where it came from."""
    from autotune import export
    from autotune.study import view
    from autotune.study.storage import load

    study = load(study_name, storage)
    ok = sorted(view.feasible(view.views(study)), key=lambda v: -v.imgs_per_s)
    if not ok:
        raise SystemExit(f"scale: study {study_name} has no feasible end-to-end trial")
    data, _ = export.build(study, ok[0])
    path = export.write(data, folder / f"best-{study_name}.yaml")
    return TrainConfig.from_yaml(path), {"study": study_name, "trial": ok[0].number,
                                         "searched_imgs_per_s": ok[0].imgs_per_s,
                                         "searched_nproc": data["autotune"]["torchrun"]["nproc_per_node"]}


def has_study(name: str, storage: str | None) -> bool:
    from autotune.study.storage import sqlite_path

    if not storage or ((path := sqlite_path(storage)) is not None and not path.exists()):
        return False
    import optuna

    return name in optuna.study.get_all_study_names(storage)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a TrainConfig YAML, e.g. an `autotune export`")
    src.add_argument("--study", help="a study's fastest feasible trial (with --storage)")
    src.add_argument("--row", help=f"a bench/run.py row: {', '.join(PLAN)}")
    p.add_argument("--storage", help="the study's storage URL (with --study)")
    p.add_argument("--or-row", help="with --study: this bench/run.py row when the storage holds no such study")
    p.add_argument("--data", help="JPEG ImageFolder for a --row")
    p.add_argument("--out", required=True)
    p.add_argument("--nproc", type=int, help="N (default: every visible GPU; 2 without GPUs)")
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--trials-dir", help="where each run's files go (default: beside --out)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override for both runs")
    args = p.parse_args()
    import yaml

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trials = Path(args.trials_dir) if args.trials_dir else out.parent
    trials.mkdir(parents=True, exist_ok=True)
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    nvml = nvml_gpu.Nvml()
    gpus = len(visible_entries(nvml.count())) if nvml.available and nvml.count() else 0
    n = args.nproc or gpus or 2
    source: dict = {}
    if args.study and args.or_row and not has_study(args.study, args.storage):
        print(f"scale: no study {args.study} in {args.storage}: running row {args.or_row} instead", flush=True)
        args.study, args.row = None, args.or_row
    if args.row:
        if args.row not in PLAN:
            p.error(f"--row {args.row}: not a bench/run.py row")
        cfg, source = row_config(args.row, args.data, common), {"row": args.row}
    else:
        if args.study:
            if not args.storage:
                p.error("--study needs --storage")
            cfg, source = from_study(args.study, args.storage, Path(tempfile.mkdtemp(dir=trials)))
        else:
            cfg, source = TrainConfig.from_yaml(args.config), {"config": str(Path(args.config).resolve())}
            doc = yaml.safe_load(Path(args.config).read_text()).get("autotune") or {}
            if doc:
                source.update(study=doc.get("study"), trial=doc.get("trial"),
                              searched_imgs_per_s=(doc.get("measured") or {}).get("imgs_per_s"),
                              searched_nproc=(doc.get("torchrun") or {}).get("nproc_per_node"))
        cfg = cfg.with_overrides({"training.mode": "measure", **common})
    label = args.row or f"{source.get('study') or Path(args.config or 'config').stem}-{source.get('trial', '')}"
    runs, notes = [], []
    worlds = [1, n] if n > 1 else [1]
    if n == 1:
        notes.append("one GPU visible: no N-GPU figure, no efficiency")
    for world in worlds:
        name = f"scale-{world}x-{label}".rstrip("-")
        t = time.time()
        res = run_one(name, cfg.with_overrides({"name": name}), world, trials, args.timeout)
        res["nproc"], res["bench_wall_s"] = world, round(time.time() - t, 1)
        runs.append(res)
        print(json.dumps({k: res.get(k) for k in ("name", "nproc", "ok", "imgs_per_s", "ci_half_width", "loss_start",
                                                  "loss_end", "util_mean", "failure", "bench_wall_s")}), flush=True)
    one = runs[0] if runs[0].get("ok") else None
    many = runs[1] if len(runs) > 1 and runs[1].get("ok") else None
    eff = many["imgs_per_s"] / (n * one["imgs_per_s"]) if one and many and one.get("imgs_per_s") else None
    if len(runs) > 1 and eff is None:
        notes.append("no efficiency: a run failed or its loss did not stand (see runs)")
    result = {"source": source, "n": n, "efficiency": round(eff, 4) if eff is not None else None,
              "one_gpu": {k: runs[0].get(k) for k in ("ok", "imgs_per_s", "ci_half_width", "loss_start", "loss_end",
                                                      "failure", "util_mean")},
              "n_gpu": {k: runs[1].get(k) for k in ("ok", "imgs_per_s", "ci_half_width", "loss_start", "loss_end",
                                                    "failure", "util_mean")} if len(runs) > 1 else None,
              "notes": notes, "runs": runs}
    out.write_text(json.dumps(result, indent=1, default=str))

    def cell(value, width: int, fmt: str) -> str:  # a figure not measured shows as n/a, never as 0
        return f"{format(value, fmt):>{width}}" if value is not None else f"{'n/a':>{width}}"

    print(f"\n{'world':<8}{'imgs/s':>10}{'per GPU':>10}{'± %':>8}{'loss start->end':>18}{'util%':>7}"
          f"  source {source}")
    for r in runs:
        ips = r.get("imgs_per_s") if r.get("ok") else None
        loss = (f"{fmt_loss(r.get('loss_start'))}->{fmt_loss(r.get('loss_end'))}" if r.get("loss_end") is not None
                else "n/a")
        half = r.get("ci_half_width") if ips else None
        print(f"{r['nproc']:<8}{cell(ips, 10, ',.0f')}{cell(ips / r['nproc'] if ips else None, 10, ',.0f')}"
              f"{cell(100 * half if half is not None else None, 8, '.1f')}{loss:>18}"
              f"{cell(r.get('util_mean'), 7, '.1f')}"
              f"  {'FAILED: ' + str(r.get('failure')) if r.get('failure') else ''}")
    print(f"scaling efficiency at {n}: " + (f"{eff:.1%}" if eff is not None else "n/a") +
          "".join(f"; {x}" for x in notes))
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
