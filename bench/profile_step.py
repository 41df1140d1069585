"""Where one training step's device time goes: torch.profiler's top kernels, eager against compiled, on one GPU.

    python3 bench/profile_step.py --out profile.json [--modes eager,compile,cudagraphs] [--batch 512] [--steps 10]
    python3 bench/profile_step.py --out smoke.json --cpu-smoke        # the script itself, on the CPU, at toy sizes
    python3 bench/profile_step.py --out dali.json --data DIR --set data.decode=dali --set data.dali_threads=8

``--data``: the steps are fed by the job's own input pipeline on that ImageFolder (``trainer.data.build_pipeline``,
``--set`` choosing it and its knobs) instead of a synthetic batch. Each mode then also says how long the training
thread waited for the next batch per step (``input_ms``: host time inside the pipeline's ``next``) and how much of
the profiled span the device was idle (``device_idle``: no kernel or copy on any stream), so an end-to-end gap below
the model's own pace reads as the pipeline holding the host (a wait, an idle device) or sharing the device (its
kernels among the top ones, a busy device).

The step is the job's own (``trainer.loop.train_step``: autocast, GradScaler for fp16, the fused optimizer, the
model built by ``trainer.model``, compiled by ``trainer.compiled``), on synthetic data made on the device, without
DDP (one GPU: DDP's hooks would add one all-reduce of a world of one). Each mode warms up (its compile included),
then ``--steps`` steps are timed with CUDA events and profiled. Per mode: the step time, the device time the
profiler saw (kernels, copies, and what launched them), the top kernels by total device time with their share of
it, and how many kernels a step launches. Writes the JSON to ``--out`` and prints a text table per mode.

Estimated wall time on 1xH200, ResNet-50 at batch 512: eager ~30 s; each compiled mode ~70-100 s cold (less with a
warm on-disk cache): about 4 minutes for the three (not measured).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import yaml

from trainer.apply import autocast, grad_scaler
from trainer.compiled import PROCESS, compile_model, compile_record
from trainer.config import TrainConfig
from trainer.data import build_pipeline
from trainer.loop import train_step
from trainer.model import build_model
from trainer.optim import build_optimizer

MODES = {"eager": {}, "compile": {"training.compile": True},
         "cudagraphs": {"training.compile": True, "training.compile_mode": "reduce-overhead"},
         "mant": {"training.compile": True, "training.compile_mode": "max-autotune-no-cudagraphs"}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default="eager,compile,cudagraphs", help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--precision", default="fp16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--warmup", type=int, default=8, help="steps before the profiled ones (compile included)")
    p.add_argument("--steps", type=int, default=10, help="profiled steps")
    p.add_argument("--top", type=int, default=15, help="kernels listed per mode")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, resnet18 at 32 px, batch 4, 2 steps")
    p.add_argument("--data", help="an ImageFolder: feed the steps from the job's input pipeline on it")
    p.add_argument("--synthetic-too", action="store_true",
                   help="with --data: each mode on a synthetic batch as well, first (the same graph: its compile is "
                        "read back from the on-disk caches for the data's run)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a TrainConfig override for --data runs (data.decode=dali, data.dali_hw_decoder_load=1.0)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.model, args.batch, args.size, args.precision = "resnet18", 4, 32, "fp32"
        args.warmup, args.steps = 2, 2
    return args


def step_config(args, mode: str, data_dir: str | None) -> TrainConfig:
    data = {"data.kind": "imagefolder", "data.path": data_dir} if data_dir else {}
    sets = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    return TrainConfig().with_overrides({
        "model.name": args.model, "data.image_size": args.size, "data.num_classes": args.classes,
        "training.batch_size": args.batch, "training.precision": args.precision,
        "training.channels_last": not args.no_channels_last, **data, **sets, **MODES[mode]})


class Timed:
    """The pipeline's batches, epoch after epoch, with the host time spent waiting in ``next``."""

    def __init__(self, pipeline):
        self.pipeline, self.it, self.wait_s, self.epoch = pipeline, iter(pipeline), 0.0, 0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            batch = next(self.it)
        except StopIteration:
            self.epoch += 1
            self.pipeline.set_epoch(self.epoch)
            self.it = iter(self.pipeline)
            batch = next(self.it)
        self.wait_s += time.perf_counter() - t0
        return batch


def device_idle(events) -> float | None:
    """The share of the span from the first to the last device event with nothing running on any stream."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    first = start
    for s0, s1 in spans[1:]:
        if s0 > end:
            busy, start, end = busy + end - start, s0, s1
        else:
            end = max(end, s1)
    busy += end - start
    last = max(s1 for _, s1 in spans)
    return round(1 - busy / max(last - first, 1e-9), 4)


def profile_mode(args, mode: str, device: torch.device, data_dir: str | None) -> dict:
    cfg = step_config(args, mode, data_dir)
    t = cfg.training
    torch.manual_seed(0)
    fmt = torch.channels_last if t.channels_last else torch.contiguous_format
    raw = build_model(cfg, args.classes).to(device, memory_format=fmt)
    model = raw
    if t.compile:
        PROCESS.reset()  # each mode compiles its own graph, from the on-disk caches where they hold it
        PROCESS.clock.install()
        model = compile_model(raw, cfg)
    before = PROCESS.clock.read()
    optimizer = build_optimizer(cfg, raw)
    scaler, amp = grad_scaler(t.precision, device), autocast(t.precision, device)
    graphs = t.compile and t.compile_mode in ("reduce-overhead", "max-autotune")
    images = torch.randn(args.batch, 3, args.size, args.size, device=device).contiguous(memory_format=fmt)
    labels = torch.randint(0, args.classes, (args.batch,), device=device)
    fed = Timed(build_pipeline(cfg, rank=0, world_size=1, device=device)) if data_dir else None

    def one():
        batches = fed if fed is not None else iter([(images, labels)])
        return train_step(model, batches, optimizer, scaler, accum_steps=1, autocast_ctx=amp, cuda_graphs=graphs)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss = one()
    sync()
    warm_s = time.perf_counter() - t0
    compiled = compile_record(before) if t.compile else {}
    # Timed without the profiler (it adds host overhead per launch, which is what CUDA graphs remove).
    t0, waited = time.perf_counter(), fed.wait_s if fed else 0.0
    for _ in range(args.steps):
        loss = one()
    sync()
    step_ms = 1000 * (time.perf_counter() - t0) / args.steps
    input_ms = 1000 * (fed.wait_s - waited) / args.steps if fed else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            loss = one()
        sync()
    if fed is not None:
        fed.pipeline.close()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        # Device-side events: kernels, memcpy/memset (on the CPU, the ops themselves stand in)
        on_device = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if device.type == "cuda" and not on_device:
            continue
        if device.type == "cpu" and (e.cpu_parent is not None or not e.name.startswith("aten::")):
            continue
        us = getattr(e, "device_time", None) if on_device else e.self_cpu_time_total
        if us is None:
            us = getattr(e, "cuda_time", 0.0)
        kernels[e.name][0] += float(us)
        kernels[e.name][1] += 1
    total_us = sum(v[0] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]
    return {"mode": mode, "fed": "data" if data_dir else "synthetic", "step_ms": round(step_ms, 3),
            "imgs_per_s": round(args.batch * 1000 / step_ms, 1),
            "warmup_s": round(warm_s, 2), **compiled, "loss": float(loss.float().item()),
            "input_ms": None if input_ms is None else round(input_ms, 3),
            "device_idle": device_idle(prof.events()) if device.type == "cuda" else None,
            "device_ms_per_step": round(total_us / 1000 / args.steps, 3),
            "kernels_per_step": round(sum(v[1] for v in kernels.values()) / args.steps, 1),
            "top": [{"name": name[:160], "ms_per_step": round(us / 1000 / args.steps, 4), "calls_per_step":
                     round(n / args.steps, 1), "share": round(us / total_us, 4) if total_us else None}
                    for name, (us, n) in top]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or use --cpu-smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False  # the job's default after the ceiling stage measured it buys nothing
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown {mode!r}; use {', '.join(MODES)}")
        for data_dir in ([None] if args.data and args.synthetic_too else []) + [args.data]:
            r = profile_mode(args, mode, device, data_dir)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "model": args.model, "batch": args.batch, "size": args.size, "precision": args.precision,
           "channels_last": not args.no_channels_last, "data": args.data, "set": args.set}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"env": env, "modes": results}, indent=1))
    for r in results:
        print(f"\n{r['mode']} ({r['fed']}): {r['step_ms']:.1f} ms/step ({r['imgs_per_s']:,.0f} imgs/s), device "
              f"{r['device_ms_per_step']:.1f} ms, {r['kernels_per_step']:.0f} kernels/step, loss {r['loss']:.3f}"
              + (f", compile {r['compile_s']:.0f} s" if "compile_s" in r else "")
              + (f", input wait {r['input_ms']:.1f} ms/step" if r["input_ms"] is not None else "")
              + (f", device idle {100 * r['device_idle']:.1f} %" if r["device_idle"] is not None else ""))
        for k in r["top"]:
            share = f"{100 * k['share']:5.1f} %" if k["share"] is not None else "   n/a"
            print(f"  {k['ms_per_step']:8.3f} ms {share} x{k['calls_per_step']:<6g} {k['name'][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
