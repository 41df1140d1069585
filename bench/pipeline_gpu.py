"""Where the time of the nvjpeg-gpu input pipeline goes, on one GPU (no model).

    python3 bench/pipeline_gpu.py DATA --out pipeline.json [--batch 256] [--workers 2,4,8,15] [--seconds 8]
    python3 bench/pipeline_gpu.py DATA --out smoke.json --cpu-smoke      # quick CPU check: no CUDA parts

DATA is a JPEG ImageFolder (``DATA/train`` is used when it exists; ``--make N`` creates it with make-data first).
Stages, each in imgs/s of one GPU:

  decode            ``decode_jpeg(list, device="cuda")`` on pre-read batches (nvJPEG alone)
  crop fp16|fp32    ``batched_resized_crop`` on one pre-decoded batch (the augmentation kernels alone)
  decode+crop       decode, box sampling, batched crop/flip/normalize: the pipeline's per-batch work, in one thread
  decode+loop       decode, then a per-image RandomResizedCrop loop: the baseline the batched crop replaces
  pipeline wN       ``GpuDecodePipeline`` with N loader workers: files -> workers -> side-stream thread -> consumer

Prints a table last and writes everything (plus versions, GPU, CPU load) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.config import TrainConfig  # noqa: E402
from trainer.gpu_decode import (BatchedDecodePipeline, GpuDecodePipeline, batched_resized_crop,  # noqa: E402
                                decode_batch, sample_crop_boxes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", help="JPEG ImageFolder root")
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", default="2,4,8,15", help="loader worker counts to try, comma-separated")
    p.add_argument("--prefetch", type=int, default=4, help="loader prefetch_factor")
    p.add_argument("--seconds", type=float, default=8.0, help="measured time per stage")
    p.add_argument("--batches", type=int, default=8, help="distinct batches pre-read for the stage measurements")
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--make", type=int, default=0, metavar="N", help="create DATA with N images first if missing")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run every stage that does not need CUDA on the CPU, small and short (checks the script)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.seconds, args.batches = min(args.batch, 8), min(args.seconds, 1.0), min(args.batches, 2)
        args.workers = "0,2"
    return args


class CpuLoad:
    """Busy fraction of all cores between start and stop, from /proc/stat (workers included)."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        idle = v[3] + v[4]
        return sum(v) - idle, sum(v)

    def stop(self) -> float | None:
        end = self._read()
        if end is None or self.start is None or end[1] == self.start[1]:
            return None
        return round((end[0] - self.start[0]) / (end[1] - self.start[1]), 3)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(name, fn, *, images_per_call, seconds, device, warmup=2, **extra) -> dict:
    for _ in range(warmup):
        fn()
    sync(device)
    load, calls, t0 = CpuLoad(), 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0 or device.type != "cuda":
            sync(device)
            if time.perf_counter() - t0 >= seconds:
                break
    elapsed = time.perf_counter() - t0
    return {"stage": name, "imgs_per_s": round(calls * images_per_call / elapsed, 1),
            "ms_per_batch": round(1000 * elapsed / calls, 3), "batches": calls, "cpu_load": load.stop(), **extra}


def read_batches(samples, batch, count, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        blobs = []
        for path, _ in rng.sample(samples, batch):
            with open(path, "rb") as f:
                blobs.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
        out.append(blobs)
    return out


def per_image_loop(images, size, generator):
    """The baseline: torchvision's RandomResizedCrop + flip per image, then stack and normalize."""
    from torchvision.transforms import v2

    crop = v2.RandomResizedCrop(size, antialias=True)
    flip = v2.RandomHorizontalFlip()
    out = torch.stack([flip(crop(im)) for im in images]).float()
    mean = torch.tensor([0.485, 0.456, 0.406], device=out.device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=out.device).view(1, 3, 1, 1) * 255
    return out.sub_(mean).div_(std)


def correctness(samples, device, size) -> dict:
    """What the CPU tests cannot see: nvJPEG's output against libjpeg-turbo's (they differ by IDCT and chroma
    upsampling, a few levels), odd files (grayscale, CMYK, a PNG named .jpg), and the batched crop on this device
    against torchvision's per-image ``resized_crop`` on the CPU."""
    import io

    from PIL import Image
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as F

    blobs = []
    for path, _ in samples[:16]:
        with open(path, "rb") as f:
            blobs.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
    ours = decode_batch(blobs, device)
    cpu = [decode_image(b, mode=ImageReadMode.RGB) for b in blobs]
    diff = torch.cat([(o.cpu().float() - c.float()).abs().flatten() for o, c in zip(ours, cpu)])
    r = {"stage": "checks", "imgs_per_s": 0.0, "ms_per_batch": 0.0, "cpu_load": None,
         "decode_vs_cpu_mean_abs": round(float(diff.mean()), 3), "decode_vs_cpu_p99_abs": float(diff.quantile(0.99))
         if diff.numel() < 2**24 else None}
    photo = Image.open(samples[0][0]).convert("RGB")
    odd = []
    for mode, fmt in (("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "PNG")):
        buf = io.BytesIO()
        photo.convert(mode).save(buf, fmt, quality=90)
        odd.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    mixed = decode_batch(odd + blobs[:2], device)
    for name, img, blob in zip(("gray", "cmyk", "png"), mixed, odd):
        ref = decode_image(blob, mode=ImageReadMode.RGB).float()
        r[f"{name}_shape_ok"] = tuple(img.shape) == tuple(ref.shape)
        r[f"{name}_mean_abs"] = round(float((img.cpu().float() - ref).abs().mean()), 3) if r[f"{name}_shape_ok"] \
            else None
    g = torch.Generator().manual_seed(0)
    boxes = sample_crop_boxes(torch.tensor([im.shape[-2] for im in ours]), torch.tensor([im.shape[-1] for im in ours]),
                              generator=g)
    ref = torch.stack([F.resized_crop(im.cpu().float(), *b.tolist(), [size, size], antialias=True)
                       for im, b in zip(ours, boxes)])
    for dt in ([torch.float32] if device.type == "cpu" else [torch.float16, torch.float32]):
        out = batched_resized_crop(ours, boxes, size, normalize=False, compute_dtype=dt).cpu()
        err = (out - ref).abs()
        name = str(dt).replace("torch.float", "fp")
        r[f"crop_{name}_vs_torchvision_mean_abs"] = round(float(err.mean()), 4)
        r[f"crop_{name}_vs_torchvision_max_abs"] = round(float(err.max()), 4)
    return r


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or use --cpu-smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    root = Path(args.data)
    if args.make and not root.exists():
        from trainer.datagen import make_image_folder

        print(json.dumps(make_image_folder(root, images=args.make, classes=100, progress=False)))
    train_root = root / "train" if (root / "train").is_dir() else root
    from torchvision.datasets.folder import find_classes, make_dataset

    _, class_to_idx = find_classes(str(train_root))
    samples = make_dataset(str(train_root), class_to_idx, extensions=(".jpg", ".jpeg", ".png"))
    channels_last = not args.no_channels_last
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "cpus": os.cpu_count(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "images": len(samples), "batch": args.batch, "size": args.size, "channels_last": channels_last}
    import torchvision

    env["torchvision"] = torchvision.__version__
    print(json.dumps(env))
    results = []

    def record(r):
        results.append(r)
        print(json.dumps(r), flush=True)

    record(correctness(samples, device, args.size))
    batches = read_batches(samples, args.batch, args.batches)
    kb = sum(len(b) for blobs in batches for b in blobs) / (1024 * args.batch * len(batches))
    env["mean_kb"] = round(kb, 1)
    g = torch.Generator().manual_seed(0)
    it = iter(range(10**12))

    def next_batch():
        return batches[next(it) % len(batches)]

    record(timed("decode", lambda: decode_batch(next_batch(), device), images_per_call=args.batch,
                 seconds=args.seconds, device=device))

    decoded = decode_batch(batches[0], device)
    heights = torch.tensor([im.shape[-2] for im in decoded])
    widths = torch.tensor([im.shape[-1] for im in decoded])
    dtypes = [torch.float32] if device.type == "cpu" else [torch.float16, torch.float32]
    for dt in dtypes:
        name = str(dt).replace("torch.float", "fp")
        boxes = sample_crop_boxes(heights, widths, generator=g)
        flip = torch.rand(len(decoded), generator=g) < 0.5
        record(timed(f"crop {name}", lambda: batched_resized_crop(decoded, boxes, args.size, flip=flip,
                                                                 channels_last=channels_last, compute_dtype=dt),
                     images_per_call=args.batch, seconds=args.seconds / 2, device=device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            batched_resized_crop(decoded, boxes, args.size, flip=flip, channels_last=channels_last, compute_dtype=dt)
            results[-1]["peak_extra_mib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)

    def decode_and_crop(dt=None):
        images = decode_batch(next_batch(), device)
        hs = torch.tensor([im.shape[-2] for im in images])
        ws = torch.tensor([im.shape[-1] for im in images])
        boxes = sample_crop_boxes(hs, ws, generator=g)
        flip = torch.rand(len(images), generator=g) < 0.5
        return batched_resized_crop(images, boxes, args.size, flip=flip, channels_last=channels_last,
                                    compute_dtype=dt)

    for dt in dtypes:
        name = str(dt).replace("torch.float", "fp")
        record(timed(f"decode+crop {name}", lambda: decode_and_crop(dt), images_per_call=args.batch,
                     seconds=args.seconds, device=device))
    record(timed("decode+loop", lambda: per_image_loop(decode_batch(next_batch(), device), args.size, g),
                 images_per_call=args.batch, seconds=args.seconds / 2, device=device, warmup=1))
    del decoded

    cls = BatchedDecodePipeline if device.type == "cpu" else GpuDecodePipeline
    for workers in [int(w) for w in args.workers.split(",") if w.strip()]:
        overrides = {"data.kind": "imagefolder", "data.path": str(root), "data.decode": "nvjpeg-gpu",
                     "data.image_size": args.size, "training.batch_size": args.batch,
                     "training.channels_last": channels_last, "loader.num_workers": workers,
                     "loader.pin_memory": True, "loader.persistent_workers": workers > 0,
                     "loader.prefetch_factor": args.prefetch if workers > 0 else None}
        cfg = TrainConfig().with_overrides(overrides)
        pipe = cls(cfg, samples, rank=0, world_size=1, device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        record(measure_pipeline(pipe, f"pipeline w{workers}", args, device, workers=workers))
        pipe.close()

    table = [f"{'stage':<22}{'imgs/s':>10}{'ms/batch':>10}{'cpu load':>10}"]
    for r in results:
        if r["stage"] == "checks":
            continue
        load = "" if r.get("cpu_load") is None else f"{100 * r['cpu_load']:.0f} %"
        table.append(f"{r['stage']:<22}{r['imgs_per_s']:>10,.0f}{r['ms_per_batch']:>10.1f}{load:>10}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(f"\n{env['device']}, torch {env['torch']}, batch {args.batch}, {env['mean_kb']} KB/JPEG, "
          f"{env['cpus']} CPUs")
    print("\n".join(table))
    checks = results[0]
    print("checks: " + ", ".join(f"{k}={v}" for k, v in checks.items() if k not in ("stage", "imgs_per_s",
                                                                                   "ms_per_batch", "cpu_load")))
    return 0


def measure_pipeline(pipe, name, args, device, *, workers) -> dict:
    """Images/s the pipeline hands a consumer that does nothing else; epochs roll over as training's would."""
    epoch, n, t0, load, warm = 0, 0, None, None, 3
    while True:
        pipe.set_epoch(epoch)
        for images, _ in pipe:
            if t0 is None:
                warm -= 1
                if warm == 0:
                    sync(device)
                    t0, load = time.perf_counter(), CpuLoad()
                continue
            n += 1
            if n % 4 == 0:
                sync(device)  # the consumer's stream waited on each batch's event: this is delivery time
                if time.perf_counter() - t0 >= args.seconds:
                    elapsed = time.perf_counter() - t0
                    r = {"stage": name, "imgs_per_s": round(n * args.batch / elapsed, 1),
                         "ms_per_batch": round(1000 * elapsed / n, 3), "batches": n, "cpu_load": load.stop(),
                         "workers": workers, "epochs": epoch + 1}
                    if device.type == "cuda":
                        r["peak_mem_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                    return r
        epoch += 1


if __name__ == "__main__":
    raise SystemExit(main())
