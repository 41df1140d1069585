"""`autotune train --config best.yaml`: a full run of the exported config (epochs, validation, checkpoints, resume),
measured against what the search found for it."""

from __future__ import annotations

import argparse
import sys

from autotune.cli import command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the YAML written by `autotune export` (or any TrainConfig YAML)")
    p.add_argument("--epochs", type=int, help="epochs to train (default: the config's training.epochs)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    p.add_argument("--out", help="run folder: checkpoints, log, result stream (default: the config's output_dir)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: the world size the search used)")
    p.add_argument("--gpus", help="GPUs to use, indices into CUDA_VISIBLE_DEVICES or UUIDs (default: the first "
                                  "nproc-per-node visible)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting by dotted path, e.g. --set data.val_fraction=0.05 (YAML value)")
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    p.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARGS",
                   help="after `--`: a user's script's own arguments for this run (default: the export's)")
    g = p.add_argument_group("torchrun, multi-node (passed through; replace the export's torchrun args)")
    for name in ("nnodes", "node-rank", "rdzv-endpoint", "rdzv-id", "rdzv-backend", "rdzv-conf", "master-addr",
                 "master-port", "max-restarts"):
        g.add_argument(f"--{name}", dest=f"torchrun_{name.replace('-', '_')}", metavar="V")


@command("train", help="run the exported best config for real: epochs, validation, checkpoints, --resume; "
                       "compares its imgs/s and GPU utilization with the search's", arguments=arguments)
def run(args) -> int:
    import yaml

    from autotune import fullrun as tr
    from autotune.hw.nvml import Nvml
    from autotune.hw.placement import parse_gpu_list
    from autotune.runner.process import log_tail

    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise tr.TrainError(f"--set {item}: expected KEY=VALUE, e.g. --set data.val_fraction=0.05")
        overrides[key.strip()] = yaml.safe_load(value)
    flags = {k[len("torchrun_"):]: v for k, v in vars(args).items() if k.startswith("torchrun_") and v is not None}
    options = tr.TrainOptions(config=args.config, epochs=args.epochs, resume=args.resume, out=args.out,
                              nproc_per_node=args.nproc_per_node, torchrun_args=flags,
                              gpus=parse_gpu_list(args.gpus), overrides=overrides,
                              script_args=list(args.script_args) if args.script_args else None)
    nvml = Nvml()
    plan = tr.plan(options, nvml=nvml)
    print(tr.describe(plan), flush=True)
    for note in plan.notes:
        print(f"autotune train: note: {note}", flush=True)
    result = tr.run(plan, progress=False if args.no_progress else None, nvml=nvml)
    if result.returncode != 0:
        for line in log_tail(plan.log_path, 15):
            print(f"  | {line}", file=sys.stderr)
        raise tr.TrainError(tr.failure_message(plan, result))
    lines, warnings, summary = tr.closing_lines(plan, result)
    for line in lines:
        print(f"autotune train: {line}")
    for w in warnings:
        print(f"autotune train: WARNING: {w}", file=sys.stderr)
    path = tr.write_summary(plan, summary)
    print(f"autotune train: figures in {path}")
    return 0
