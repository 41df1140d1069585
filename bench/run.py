"""Run named job configs on this machine's GPUs, exactly as the tuner launches a trial, and record the figures.

    python3 bench/run.py --data /tmp/jpegs --out results.json seed-default strong-pil strong-synthetic ...

Each run is a fresh `torchrun -m trainer` through autotune.runner (same env, same watchdog as a trial), with the
NVML sampler of autotune.hw on the run's GPUs and a CPU-load sampler; only samples inside the job's measurement
windows count.
Prints a table last. `bench/configs/*.yaml` hold the configs; PLAN maps run names to a config plus overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.hw import nvml as nvml_gpu
from autotune.hw.cpu import CpuSampler, busy_share
from autotune.hw.placement import to_nvml, visible_entries
from autotune.runner.trial import TrialJob, run_trial
from autotune.verdict import judge
from trainer.config import TrainConfig

HERE = Path(__file__).resolve().parent
LOADER = {"training.mode": "loader"}
# The ceiling of issue #22's table: synthetic data, fp16, channels_last, batch 512 on one H200.
CEIL = {"data.kind": "synthetic", "training.precision": "fp16", "training.channels_last": True,
        "training.batch_size": 512}
COMPILED = {"training.compile": True}
CEILINGS: dict[str, tuple[str, dict]] = {
    "ceil-eager": ("strong", CEIL),  # ~35 s
    "ceil-compile": ("strong", {**CEIL, **COMPILED}),  # ~110 s cold (81 s measured for the row before #22)
    "ceil-cudagraphs": ("strong", {**CEIL, **COMPILED, "training.compile_mode": "reduce-overhead"}),  # ~110 s cold
    # Triton autotunes every conv and matmul shape: minutes of compile (not measured); named by hand only.
    "ceil-compile-mant": ("strong", {**CEIL, **COMPILED, "training.compile_mode": "max-autotune-no-cudagraphs"}),
    "ceil-max-autotune": ("strong", {**CEIL, **COMPILED, "training.compile_mode": "max-autotune"}),
}
SUPPLIES: dict[str, tuple[str, dict]] = {  # the loader alone, batch 512, ~30 s each
    "supply-nvjpeg": ("strong", {**LOADER, "data.decode": "nvjpeg-gpu", "loader.num_workers": 6,
                                 "training.batch_size": 512}),
    "supply-tvcpu": ("strong", {**LOADER, "data.decode": "torchvision-cpu", "loader.num_workers": 15,
                                "training.batch_size": 512}),
    # hybrid 50 % alone (bench/gpu.sh's dali stage names it)
    "supply-split-50-0": ("strong", {**LOADER, "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5,
                                     "loader.num_workers": 12, "training.batch_size": 512}),
    # DALI (pip install '.[dali]'): its own reader threads, no DataLoader; hw_decoder_load at DALI's 0.65 and around.
    "supply-dali": ("strong", {**LOADER, "data.decode": "dali", "data.dali_threads": 8, "training.batch_size": 512}),
    **{f"supply-dali-hw-{h}": ("strong", {**LOADER, "data.decode": "dali", "data.dali_threads": 8,
                                         "data.dali_hw_decoder_load": h / 100, "training.batch_size": 512})
       for h in (50, 95)},
}
E2E = {"training.precision": "fp16", "training.channels_last": True, "training.batch_size": 512}
END_TO_END: dict[str, tuple[str, dict]] = {  # the JPEGs, fp16, CL, batch 512: ~40 s eager, compiled as above
    "e2e-hybrid-50": ("strong", {**E2E, "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5,
                                 "loader.num_workers": 12}),
    "e2e-hybrid-50-compile": ("strong", {**E2E, **COMPILED, "data.decode": "hybrid",
                                         "data.hybrid_cpu_fraction": 0.5, "loader.num_workers": 12}),
    "e2e-hybrid-50-cudagraphs": ("strong", {**E2E, **COMPILED, "training.compile_mode": "reduce-overhead",
                                            "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5,
                                            "loader.num_workers": 12}),
    "e2e-nvjpeg": ("strong", {**E2E, "data.decode": "nvjpeg-gpu", "loader.num_workers": 6}),
    # The decode paths side by side at the ceiling's settings (issue #40's hand rows for a small classifier:
    # hand-NAME=ceil-eager,supply-nvjpeg,e2e-nvjpeg,e2e-hybrid-25,e2e-hybrid-50,e2e-tvcpu,...).
    "e2e-hybrid-25": ("strong", {**E2E, "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.25,
                                 "loader.num_workers": 12}),
    "e2e-tvcpu": ("strong", {**E2E, "data.decode": "torchvision-cpu", "loader.num_workers": 15}),
    **{f"e2e-dali-hw-{h}": ("strong", {**E2E, "data.decode": "dali", "data.dali_threads": 8,
                                      "data.dali_hw_decoder_load": h / 100}) for h in (35, 65, 95)},
    "e2e-dali": ("strong", {**E2E, "data.decode": "dali", "data.dali_threads": 8}),
    "e2e-dali-compile": ("strong", {**E2E, **COMPILED, "data.decode": "dali", "data.dali_threads": 8}),
}
# Issue #26: the best DALI trial of a fresh search on 1xH200 (6,728 imgs/s, 91 % of the compiled ceiling; its GPU idle
# 3-7 % of the windows, the ceiling's never), compiled as the search runs it and with CUDA graphs, which launch the
# step's kernels without the host: whether that idle share is the training thread's launches held up by DALI's
# threads. Each beside the model alone the same way; cuDNN's search off, as the search's stages left it.
# What the search's trials run beside the knobs: its lr (0.1 per 256 images) and cuDNN's search off, as the stages
# left it for ResNet-50 (it cost ~13 s of first step per fresh process and bought nothing measurable).
AS_SEARCHED = {"optimizer.lr": 0.1, "training.cudnn_benchmark": False}
DALI_BEST = {"data.decode": "dali", "data.dali_hw_decoder_load": 0.35, "data.dali_threads": 13, "data.dali_prefetch": 3}
GRAPH_MODES = {"compile": COMPILED, "cudagraphs": {**COMPILED, "training.compile_mode": "reduce-overhead"}}
LAUNCH: dict[str, tuple[str, dict]] = {
    **{f"{row}-{mode}": ("strong", {**base, **how, **AS_SEARCHED})
       for row, base in (("ceil-best", CEIL), ("e2e-dali-best", {**E2E, **DALI_BEST}))
       for mode, how in GRAPH_MODES.items()},
    # The same DALI trial with the Huffman decoding of the images off the hardware engines done with the GPU's help
    # (its profile: the CPU-Huffman share cost 5.3 ms of copies a step and the host waited 9 ms for each batch), at
    # the engines' share it had and at DALI's own 0.65; each beside its loader alone.
    **{f"{row}-gpuhuff{'' if h == 0.35 else f'-{round(100 * h)}'}": (
        "strong", {**base, **DALI_BEST, "data.dali_gpu_huffman": True, "data.dali_hw_decoder_load": h, **AS_SEARCHED})
       for row, base in (("e2e-dali-best", {**E2E, **COMPILED}), ("supply-dali-best", {**LOADER, **E2E}))
       for h in (0.35, 0.65)},
    "supply-dali-best": ("strong", {**LOADER, **E2E, **DALI_BEST}),
    # The same trial with more of the decode on the engines: the CPU-Huffman share's inverse DCT and colour
    # conversion (3.4 ms of SM time a step at 0.35, beside the model's kernels) shrinks with it, yet the searches'
    # trials at 0.5-0.95 came out 1-9 % below 0.35's. Each beside its loader alone: whether the engines keep up.
    **{f"{row}-hw-{h}": ("strong", {**base, **DALI_BEST, "data.dali_hw_decoder_load": h / 100, **AS_SEARCHED})
       for row, base in (("e2e-dali-best", {**E2E, **COMPILED}), ("supply-dali-best", {**LOADER, **E2E}))
       for h in (50, 65, 80, 95)},
}
# Issue #41: the shape of DALI's graph against today's (the crop decoded alone, float32 out, antialiased resize),
# compiled as the search runs it: the whole image decoded then cropped on the GPU (MLPerf's shape), float16 out,
# no antialias; the engines' share at 0.35, 0.65 and 0.99, DALI's threads 6 and 16, its queue 2 and 5, and MLPerf's
# own settings together. The dali stage of bench/gpu.sh runs them with DALI_ROWS="$(python3 bench/run.py --list
# shape-)".
DALI_SHAPES = {"roi": {}, "full": {"data.dali_crop": "full"}, "half": {"data.dali_half_out": True},
               "full-half": {"data.dali_crop": "full", "data.dali_half_out": True},
               "half-noaa": {"data.dali_half_out": True, "data.dali_antialias": False},
               "full-half-noaa": {"data.dali_crop": "full", "data.dali_half_out": True, "data.dali_antialias": False}}
DALI_E2E = {**E2E, **COMPILED, **DALI_BEST, **AS_SEARCHED}
SHAPES: dict[str, tuple[str, dict]] = {
    **{f"shape-{name}": ("strong", {**DALI_E2E, **shape}) for name, shape in DALI_SHAPES.items()},
    **{f"shape-{name}-hw-{h}": ("strong", {**DALI_E2E, **DALI_SHAPES[name], "data.dali_hw_decoder_load": h / 100})
       for name in ("roi", "full-half") for h in (65, 99)},
    **{f"shape-full-half-thr-{t}": ("strong", {**DALI_E2E, **DALI_SHAPES["full-half"], "data.dali_threads": t})
       for t in (6, 16)},
    **{f"shape-full-half-q-{q}": ("strong", {**DALI_E2E, **DALI_SHAPES["full-half"], "data.dali_prefetch": q})
       for q in (2, 5)},
    "shape-mlperf": ("strong", {**DALI_E2E, **DALI_SHAPES["full-half"], "data.dali_hw_decoder_load": 0.99,
                                "data.dali_threads": 6, "data.dali_prefetch": 5}),
    "supply-shape-full-half": ("strong", {**LOADER, **E2E, **DALI_BEST, **DALI_SHAPES["full-half"]}),
}
# ---- issue #21: the DDP and NCCL knobs, each alone against DDP_BASE, on the best end-to-end config known
# (e2e-hybrid-50: hybrid 50 %, fp16, channels_last, bs 512 per GPU, 12 workers per rank). Two changes that do not
# change the step: the search's lr 0.1 (strong's 0.4 sent nvjpeg-gpu fp16 to NaN on 2xH200 on 2026-11-30, and a
# void row says nothing about a knob) and cudnn.benchmark off (it bought nothing measurable for ResNet-50 here and
# cost ~13 s of first step per fresh process). Estimated ~35 s per row on 4 GPUs: ~5.5 min for the nine.
DDP_BASE = {**E2E, "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5, "loader.num_workers": 12, **AS_SEARCHED}
CEIL_DDP_BASE = {**CEIL, **AS_SEARCHED}
DDP_KNOBS: dict[str, dict] = {  # ddp.* defaults: bucket 25 MB, gradient_as_bucket_view off, static_graph off
    "base": {},
    "bucket-5": {"ddp.bucket_cap_mb": 5.0},
    "bucket-100": {"ddp.bucket_cap_mb": 100.0},
    "gabv": {"ddp.gradient_as_bucket_view": True},
    "static": {"ddp.static_graph": True},  # accum_steps 1 here: the combination the config allows
}
NCCL_KNOBS: dict[str, dict] = {  # all-reduce algorithm and protocol; never LL128, never NVLS (the launcher refuses)
    "ring": {"nccl.algo": "Ring"},
    "tree": {"nccl.algo": "Tree"},
    "simple": {"nccl.proto": "Simple"},
    "ll": {"nccl.proto": "LL"},
}
DDP_ROWS: dict[str, tuple[str, dict]] = {
    **{f"ddp-{k}": ("strong", {**DDP_BASE, **v}) for k, v in DDP_KNOBS.items()},
    **{f"nccl-{k}": ("strong", {**DDP_BASE, **v}) for k, v in NCCL_KNOBS.items()},
    # The same knobs where communication is the larger share of a step: the compute ceiling (synthetic data).
    **{f"ceil-ddp-{k}": ("strong", {**CEIL_DDP_BASE, **v}) for k, v in DDP_KNOBS.items()},
    **{f"ceil-nccl-{k}": ("strong", {**CEIL_DDP_BASE, **v}) for k, v in NCCL_KNOBS.items()},
}
# The workers grid a search's best is weighed against (issue #47): nvJPEG and hybrid 25/50 % at 6, 10 and 14 loader
# workers per rank, fp16, channels_last, batch 512; windows of at most 8 s, so nine rows fit in a few minutes.
GRID: dict[str, tuple[str, dict]] = {
    f"grid-{name}-wk{wk}": ("strong", {**E2E, **decode, "loader.num_workers": wk, "measure.max_s": 8})
    for name, decode in (("nvjpeg", {"data.decode": "nvjpeg-gpu"}),
                         ("hybrid-25", {"data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.25}),
                         ("hybrid-50", {"data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5}))
    for wk in (6, 10, 14)}
PLAN: dict[str, tuple[str, dict]] = {
    "seed-default": ("seed-default", {}),
    "strong-pil": ("strong", {"data.decode": "pil"}),
    "strong-tvcpu": ("strong", {"data.decode": "torchvision-cpu"}),
    "strong-synthetic": ("strong", {"data.kind": "synthetic"}),
    "strong-nvjpeg-bf16": ("strong", {"data.decode": "nvjpeg-gpu", "loader.num_workers": 6}),
    "strong-nvjpeg-fp16": ("strong", {"data.decode": "nvjpeg-gpu", "loader.num_workers": 6,
                                      "training.precision": "fp16"}),
    "synthetic-fp16": ("strong", {"data.kind": "synthetic", "training.precision": "fp16"}),
    "synthetic-fp16-compile": ("strong", {"data.kind": "synthetic", "training.precision": "fp16",
                                          "training.compile": True}),
    "strong-nvjpeg-fp16-compile": ("strong", {"data.decode": "nvjpeg-gpu", "loader.num_workers": 6,
                                              "training.precision": "fp16", "training.compile": True}),
    "strong-nvjpeg-bf16-compile": ("strong", {"data.decode": "nvjpeg-gpu", "loader.num_workers": 6,
                                              "training.compile": True}),
    "loader-pil": ("strong", {**LOADER, "data.decode": "pil"}),
    "loader-tvcpu": ("strong", {**LOADER, "data.decode": "torchvision-cpu"}),
    "loader-nvjpeg": ("strong", {**LOADER, "data.decode": "nvjpeg-gpu", "loader.num_workers": 6}),
    # hybrid: a share of every batch decoded by the workers (torchvision-cpu), the rest by nvJPEG.
    **{f"strong-hybrid-fp16-{pct}": ("strong", {"data.decode": "hybrid", "data.hybrid_cpu_fraction": pct / 100,
                                                "loader.num_workers": 12, "training.precision": "fp16"})
       for pct in (25, 50, 75)},
    "loader-hybrid-50": ("strong", {**LOADER, "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.5,
                                    "loader.num_workers": 12}),
    # ---- issue #22 on 1xH200 (estimates per row: a fresh process pays ~15 s of launch, import and set-up, then
    # warm-up and windows until the interval is within 1 %: ~35 s; a cold ResNet-50 compile adds ~60-80 s, less where
    # an earlier row of the call compiled the same graph into the shared on-disk cache).
    **CEILINGS,
    **SUPPLIES,
    **END_TO_END,
    **LAUNCH,
    **SHAPES,
    **DDP_ROWS,
    **GRID,
}


def row_config(name: str, data: str | None, common: dict) -> TrainConfig:
    """The TrainConfig of PLAN row ``name``: its base config, its overrides (their CPU stand-ins under DRY=1), the
    data folder and the overrides given for every run."""
    base, overrides = PLAN[name]
    cfg = TrainConfig.from_yaml(HERE / "configs" / f"{base}.yaml")
    where = {"data.path": data} if data else {}
    return cfg.with_overrides({**where, **dry_run(overrides), **common, "name": name})


def run_one(name: str, cfg: TrainConfig, nproc: int, out_dir: Path, timeout: float) -> dict:
    nvml = nvml_gpu.Nvml()
    gpus = to_nvml(nvml, visible_entries(nvml.count())[:nproc]) if nvml.available else []
    sampler = nvml_gpu.Sampler(nvml, gpus).start()
    cpu = CpuSampler().start()
    run = run_trial(TrialJob(config=cfg, trial_dir=out_dir / name, nproc_per_node=nproc,
                             gpus=[g.uuid for g in gpus] or None, timeout_s=timeout))
    samples, readings = sampler.stop(), cpu.stop()
    busy = busy_share(readings, run.steady_windows)
    summary = run.summary or {}
    # A run that does not learn is not fast (``diverged``): its imgs/s is kept in the raw JSON, never shown as a
    # figure.
    v = judge(run)
    return {
        "name": name, "ok": v.ok, "failure": v.failure, "failure_message": v.reason,
        "loss_start": summary.get("loss_start"), "loss_end": summary.get("loss_end"),
        "loss_finite": summary.get("loss_finite"), "loss_nonfinite_steps": summary.get("loss_nonfinite_steps"),
        "imgs_per_s": summary.get("imgs_per_s"), "imgs_per_s_windows": summary.get("imgs_per_s_windows"),
        "ci_half_width": summary.get("ci_half_width"), "precise": summary.get("precise"),
        "peak_mem_bytes": summary.get("peak_mem_bytes"),
        "cpu_busy_pct": round(100 * busy, 1) if busy is not None else None,
        "data_wait_share": summary.get("data_wait_share"), "step_split": summary.get("step_split"),
        **nvml_gpu.summarize(samples, run.steady_windows, len(gpus)), **run.timing(),
        "compile_s": summary.get("compile_s"), "compiles": summary.get("compiles"),
        "first_step": (run.of_kind("first_step") or [None])[0],
        "versions": summary.get("versions"), "config": cfg.to_dict(),
    }


def run_bare(nproc: int, out_dir: Path) -> dict:
    out = out_dir / "bare.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "bare_ddp.py"), "--batch", "256", "--precision", "bf16", "--channels-last", "--out", str(out)]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                            "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"name": "bare-synthetic", "ok": False, "failure_message": proc.stderr[-2000:]}
    data = json.loads(out.read_text())
    return {"name": "bare-synthetic", "ok": True, "imgs_per_s": data["imgs_per_s"],
            "imgs_per_s_windows": data["windows"], "window_spread": data["spread"]}


def dry_run(overrides: dict) -> dict:
    """``DRY=1`` on a machine without GPUs (``bench/gpu.sh``'s smoke run): a GPU-decode row runs the same pipeline's
    CPU stand-in (``hybrid`` decodes its device share with libjpeg-turbo on a CPU device; ``dali`` runs its graph on
    DALI's CPU operators): the plumbing is checked, never a figure."""
    if not os.environ.get("DRY") or nvml_gpu.Nvml().count():
        return overrides
    decode = overrides.get("data.decode")
    if decode == "nvjpeg-gpu":
        return {**overrides, "data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.0}
    if decode == "dali":  # DALI's CPU operators: one thread of the smoke run's cores
        overrides = {**overrides, "data.dali_threads": 1}
    if overrides.get("training.precision") == "fp16":  # CPU autocast is bf16
        return {**overrides, "training.precision": "bf16"}
    return overrides


def fmt_loss(x) -> str:
    return "n/a" if x is None else f"{x:.3f}" if abs(x) < 1e4 else f"{x:.2g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", help=f"run names: {', '.join(PLAN)}, bare-synthetic")
    p.add_argument("--config",
                   help="a TrainConfig YAML (e.g. an `autotune export`), run --repeat times in measure mode")
    p.add_argument("--repeat", type=int, default=3, help="how often to run --config (default 3)")
    p.add_argument("--label", help="run name prefix for --config runs (default: the file's stem)")
    p.add_argument("--data", help="JPEG ImageFolder for the imagefolder runs")
    p.add_argument("--nproc", type=int, help="ranks (default: every visible GPU; 2 without GPUs)")
    p.add_argument("--out", help="JSON file for all results (trial logs go beside it)")
    p.add_argument("--list", metavar="PREFIX", help="print the names of the rows that start with PREFIX, and exit")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--against", metavar="RUN",
                   help="a run of this list that the table sets every other against (imgs/s as a ratio of its)")
    p.add_argument("--start-before", type=float, metavar="S",
                   help="start no run after S seconds (a call's deadline); the runs left are listed as not run")
    p.add_argument("--trials-dir", help="where each run's config, log and JSON lines go (default: beside --out)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run")
    args = p.parse_args()
    if args.list is not None:
        print(" ".join(name for name in PLAN if name.startswith(args.list)))
        return 0
    if not args.out:
        p.error("--out is required")
    import yaml

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trials = Path(args.trials_dir) if args.trials_dir else out.parent
    common = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    if args.nproc is None:
        nvml = nvml_gpu.Nvml()
        args.nproc = len(visible_entries(nvml.count())) if nvml.available and nvml.count() else 2
    results = []
    runs = list(args.runs)
    if args.config:
        label = args.label or Path(args.config).stem
        runs += [f"{label}-{i + 1}" for i in range(args.repeat)]
    if not runs:
        p.error("name runs or pass --config")
    unknown = [n for n in args.runs if n not in PLAN and n != "bare-synthetic"]
    if unknown:
        p.error(f"unknown run(s): {', '.join(unknown)} (see PLAN in {__file__})")
    began = time.time()
    for name in runs:
        t = time.time()
        if args.start_before is not None and t - began > args.start_before:
            res = {"name": name, "ok": False, "failure": "not run",
                   "failure_message": f"not started: {args.start_before:.0f} s of this call's rows were spent"}
        elif name == "bare-synthetic":
            res = run_bare(args.nproc, trials)
        elif args.config and name.startswith((args.label or Path(args.config).stem) + "-"):
            # The exported config as the search measured it: measure mode, same data, same world size.
            cfg = TrainConfig.from_yaml(args.config)
            cfg = cfg.with_overrides({"training.mode": "measure", **common, "name": name})
            res = run_one(name, cfg, args.nproc, trials, args.timeout)
        else:
            res = run_one(name, row_config(name, args.data, common), args.nproc, trials, args.timeout)
        res["bench_wall_s"] = round(time.time() - t, 1)
        results.append(res)
        out.write_text(json.dumps(results, indent=1, default=str))
        keys = ("name", "ok", "imgs_per_s", "ci_half_width", "loss_start", "loss_end", "util_mean", "cpu_busy_pct",
                "failure",
                "compile_s", "bench_wall_s")
        print(json.dumps({k: res.get(k) for k in keys}), flush=True)
    def cell(value, width, fmt):  # a figure not measured (no GPU, a failed run) shows as n/a, never as 0
        return f"{format(value, fmt):>{width}}" if value is not None else f"{'n/a':>{width}}"

    ref = next((r for r in results if r["name"] == args.against and r.get("ok") and r.get("imgs_per_s")), None)
    print(f"\n{'run':<26}{'imgs/s':>10}{'± %':>8}{'loss start->end':>18}{'util%':>7}{'mem GiB':>9}{'cpu%':>6}"
          f"{'compile s':>10}{'wall s':>8}" + (f"{'vs ' + args.against:>22}" if args.against else ""))
    for r in results:
        mem = r.get("mem_used_max_mib")
        # A failed run (a diverged loss included) shows no imgs/s: that figure would not describe training.
        ips = r.get("imgs_per_s") if r.get("ok") else None
        loss = (f"{fmt_loss(r.get('loss_start'))}->{fmt_loss(r.get('loss_end'))}" if r.get("loss_end") is not None
                else "n/a")
        half = r.get("ci_half_width") if ips else None
        print(f"{r['name']:<26}{cell(ips, 10, ',.0f')}{cell(100 * half if half is not None else None, 8, '.1f')}"
              f"{loss:>18}"
              f"{cell(r.get('util_mean'), 7, '.1f')}{cell(mem / 1024 if mem is not None else None, 9, '.1f')}"
              f"{cell(r.get('cpu_busy_pct'), 6, '.0f')}{cell(r.get('compile_s'), 10, '.1f')}"
              f"{cell(r.get('bench_wall_s'), 8, '.0f')}"
              + (cell(ips / ref["imgs_per_s"] if ref and ips else None, 22, '.3f') if args.against else "")
              + f"  {'FAILED: ' + r['failure'] if r.get('failure') else ''}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
