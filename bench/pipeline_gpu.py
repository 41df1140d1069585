"""Where the time of the nvjpeg-gpu and hybrid input pipelines goes, on one GPU.

    python3 bench/pipeline_gpu.py DATA --out pipeline.json [--batch 256] [--workers 6] [--hybrid 0.25,0.5] [--train]
    python3 bench/pipeline_gpu.py DATA --out smoke.json --cpu-smoke      # quick CPU check of every stage

DATA is a JPEG ImageFolder (``DATA/train`` is used when it exists; ``--make N`` creates it with make-data first).
Stages, each in imgs/s of one GPU, with wall ms per batch and, from CUDA events on the stage's stream, GPU ms:

  decode            ``decode_jpeg(list, device="cuda")`` on pre-read batches in one pinned buffer, as the pipeline
                    feeds it; ``decode pageable``: the same from pageable tensors
  crop fp16|fp32    ``batched_resized_crop`` on one pre-decoded batch (the augmentation kernels alone)
  decode+crop fp16  decode, box sampling, batched crop/flip/normalize: the pipeline's per-batch work, in one thread
  decode+loop       (``--loop``) decode, then a per-image RandomResizedCrop loop: what the batched crop replaces
  pipeline wN       ``GpuDecodePipeline`` with N loader workers: files -> workers -> side-stream thread -> consumer
  hybridP wN        ``HybridDecodePipeline`` with P % of each batch decoded by the N workers
  train ...         (``--train``) a ResNet-50 training loop (``--precision``, channels_last, no DDP) fed by
                    synthetic data, by the pipeline (side stream at high priority, and at priority 0, as before),
                    and by the hybrid pipeline: what training on one GPU loses to each, with the GIL shared as in the
                    job

GPU columns: ``gpu ms`` is the span between events recorded before and after each call on the stage's stream
(includes waits for the host); ``busy ms`` is the same with the stream held by a sleep kernel until the host has
queued the whole call, so it counts only device execution (``gate_short`` flags a sleep that ended too early). The
decode's own work runs on nvJPEG's stream, so for it only the span means something. Prints a table last and writes
everything (plus versions, GPU, CPU load) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.config import TrainConfig
from trainer.data.cpu import DeviceNormalize
from trainer.data.gpu.crop import batched_resized_crop, normalize_into, sample_crop_boxes
from trainer.data.gpu.datasets import pack_bytes, unpack_bytes
from trainer.data.gpu.decode import decode_batch
from trainer.data.gpu.pipeline import BatchedDecodePipeline, GpuDecodePipeline, HybridDecodePipeline


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", help="JPEG ImageFolder root")
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", default="6", help="loader worker counts for the pipeline stages, comma-separated")
    p.add_argument("--hybrid", default="0.5", help="hybrid CPU fractions, comma-separated (empty: none)")
    p.add_argument("--hybrid-workers", type=int, default=12, help="loader workers of the hybrid stages")
    p.add_argument("--prefetch", type=int, default=4, help="loader prefetch_factor")
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per stage")
    p.add_argument("--batches", type=int, default=8, help="distinct batches pre-read for the stage measurements")
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--loop", action="store_true", help="also time the per-image RandomResizedCrop loop")
    p.add_argument("--train", action="store_true", help="also time a training loop fed by each pipeline")
    p.add_argument("--model", default="resnet50", help="torchvision model of the train stages")
    p.add_argument("--precision", default="fp16", choices=["fp32", "bf16", "fp16"], help="train stages' autocast")
    p.add_argument("--make", type=int, default=0, metavar="N", help="create DATA with N images first if missing")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run every stage on the CPU, small and short (checks the script, not the numbers)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.seconds, args.batches = min(args.batch, 8), min(args.seconds, 1.0), min(args.batches, 2)
        args.workers, args.hybrid_workers, args.size = "0,2", 2, min(args.size, 64)
        args.model, args.precision = "resnet18", "fp32"
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


def timed(name, fn, *, images_per_call, seconds, device, warmup=2, busy=False, **extra) -> dict:
    """Wall time per call, then (CUDA) the GPU span per call and, with ``busy``, the gated device time."""
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
    r = {"stage": name, "imgs_per_s": round(calls * images_per_call / elapsed, 1),
         "ms_per_batch": round(1000 * elapsed / calls, 3), "batches": calls, "cpu_load": load.stop(), **extra}
    if device.type == "cuda":
        r["gpu_ms"] = gpu_span_ms(fn, device)
        if busy:
            r.update(gpu_busy_ms(fn, device, wall_ms=r["ms_per_batch"]))
    return r


def gpu_span_ms(fn, device, calls: int = 4) -> float:
    """Mean time between events recorded on the current stream before and after each call (one call at a time)."""
    total = 0.0
    for _ in range(calls):
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
    return round(total / calls, 3)


def gpu_busy_ms(fn, device, *, wall_ms: float, calls: int = 4) -> dict:
    """Device execution time per call: a sleep kernel holds the stream while the host queues the call, so the
    events around it see no host gaps. ``gate_short``: the sleep ended before the host was done (span includes
    host time)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    start.record()
    sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    total, short = 0.0, False
    for _ in range(calls):
        sync(device)
        sleep(int(cycles_per_ms * (2 * wall_ms + 5)))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        short = short or start.query()  # the gate already passed: the host was slower than the sleep
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
    return {"gpu_busy_ms": round(total / calls, 3), "gate_short": bool(short)}


def read_batches(samples, batch, count, seed=0):
    """Pre-read batches, each as the pipeline's loader delivers it: one packed (pinned on CUDA) buffer + lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        blobs = []
        for path, _ in rng.sample(samples, batch):
            with open(path, "rb") as f:
                blobs.append(f.read())
        out.append(pack_bytes(blobs))
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
    upsampling, a few levels), odd files (grayscale, CMYK, a PNG named .jpg), the batched crop on this device
    against torchvision's per-image ``resized_crop`` on the CPU, and the hybrid path's on-device normalization."""
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
    diff = torch.cat([(o.cpu().float() - c.float()).abs().flatten() for o, c in zip(ours, cpu, strict=True)])
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
    for name, img, blob in zip(("gray", "cmyk", "png"), mixed, odd, strict=False):  # mixed has 2 more
        ref = decode_image(blob, mode=ImageReadMode.RGB).float()
        r[f"{name}_shape_ok"] = tuple(img.shape) == tuple(ref.shape)
        r[f"{name}_mean_abs"] = round(float((img.cpu().float() - ref).abs().mean()), 3) if r[f"{name}_shape_ok"] \
            else None
    g = torch.Generator().manual_seed(0)
    boxes = sample_crop_boxes(torch.tensor([im.shape[-2] for im in ours]), torch.tensor([im.shape[-1] for im in ours]),
                              generator=g)
    flip = torch.rand(len(ours), generator=g) < 0.5
    ref = torch.stack([F.resized_crop(im.cpu().float(), *b.tolist(), [size, size], antialias=True)
                       for im, b in zip(ours, boxes, strict=True)])
    ref = torch.where(flip.view(-1, 1, 1, 1), ref.flip(-1), ref)
    for dt in ([torch.float32] if device.type == "cpu" else [torch.float16, torch.float32]):
        for groups, max_cells in (("", 2**25), (" grouped", 2**18)):
            out = batched_resized_crop(ours, boxes, size, flip=flip, normalize=False, compute_dtype=dt,
                                       max_cells=max_cells).cpu()
            err = (out - ref).abs()
            name = str(dt).replace("torch.float", "fp") + groups.replace(" ", "_")
            r[f"crop_{name}_vs_torchvision_mean_abs"] = round(float(err.mean()), 4)
            r[f"crop_{name}_vs_torchvision_max_abs"] = round(float(err.max()), 4)
    u8 = torch.stack([F.resize(c, [size, size], antialias=True) for c in cpu[:4]])
    target = torch.empty(u8.shape, dtype=torch.float32, device=device).contiguous(memory_format=torch.channels_last)
    ours_norm = normalize_into(target, u8.pin_memory().to(device) if device.type == "cuda" else u8).cpu()
    ref_norm = DeviceNormalize(torch.device("cpu"), channels_last=True)(u8)
    r["hybrid_normalize_max_abs"] = float((ours_norm - ref_norm).abs().max())
    return r


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or use --cpu-smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
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
    packed = read_batches(samples, args.batch, args.batches)
    kb = sum(len(buf) for buf, _ in packed) / (1024 * args.batch * len(packed))
    env["mean_kb"] = round(kb, 1)
    pinned = [(buf.pin_memory() if device.type == "cuda" else buf, lengths) for buf, lengths in packed]
    batches = [unpack_bytes(buf, lengths) for buf, lengths in pinned]
    pageable = [[v.clone() for v in unpack_bytes(buf, lengths)] for buf, lengths in packed]
    g = torch.Generator().manual_seed(0)
    it = iter(range(10**12))

    def next_batch(source=batches):
        return source[next(it) % len(source)]

    record(timed("decode", lambda: decode_batch(next_batch(), device), images_per_call=args.batch,
                 seconds=args.seconds, device=device))
    if device.type == "cuda":
        record(timed("decode pageable", lambda: decode_batch(next_batch(pageable), device),
                     images_per_call=args.batch, seconds=args.seconds / 2, device=device))

    decoded = decode_batch(batches[0], device)
    heights = torch.tensor([im.shape[-2] for im in decoded])
    widths = torch.tensor([im.shape[-1] for im in decoded])
    dtypes = [torch.float32] if device.type == "cpu" else [torch.float16, torch.float32]
    for dt in dtypes:
        name = str(dt).replace("torch.float", "fp")
        boxes = sample_crop_boxes(heights, widths, generator=g)
        flip = torch.rand(len(decoded), generator=g) < 0.5
        crop = partial(batched_resized_crop, decoded, boxes, args.size, flip=flip, channels_last=channels_last,
                       compute_dtype=dt)
        record(timed(f"crop {name}", crop,
                     images_per_call=args.batch, seconds=args.seconds / 2, device=device, busy=True))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            batched_resized_crop(decoded, boxes, args.size, flip=flip, channels_last=channels_last, compute_dtype=dt)
            results[-1]["peak_extra_mib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)

    def decode_and_crop():
        sync(device)  # as the pipeline's thread does before each decode (nvJPEG writes from its own stream)
        images = decode_batch(next_batch(), device)
        hs = torch.tensor([im.shape[-2] for im in images])
        ws = torch.tensor([im.shape[-1] for im in images])
        boxes = sample_crop_boxes(hs, ws, generator=g)
        flip = torch.rand(len(images), generator=g) < 0.5
        return batched_resized_crop(images, boxes, args.size, flip=flip, channels_last=channels_last)

    record(timed(f"decode+crop {'fp16' if device.type == 'cuda' else 'fp32'}", decode_and_crop,
                 images_per_call=args.batch, seconds=args.seconds, device=device))
    if args.loop:
        record(timed("decode+loop", lambda: per_image_loop(decode_batch(next_batch(), device), args.size, g),
                     images_per_call=args.batch, seconds=args.seconds / 2, device=device, warmup=1))
    del decoded

    fractions = [float(f) for f in args.hybrid.split(",") if f.strip()]
    workers = [int(w) for w in args.workers.split(",") if w.strip()]

    def pipeline(kind, n_workers, fraction=None, priority=-1):
        overrides = {"data.kind": "imagefolder", "data.path": str(root), "data.image_size": args.size,
                     "data.decode": "hybrid" if kind == "hybrid" else "nvjpeg-gpu",
                     "training.batch_size": args.batch, "training.channels_last": channels_last,
                     "loader.num_workers": n_workers, "loader.pin_memory": True,
                     "loader.persistent_workers": n_workers > 0,
                     "loader.prefetch_factor": args.prefetch if n_workers > 0 else None}
        if fraction is not None:
            overrides["data.hybrid_cpu_fraction"] = fraction
        cfg = TrainConfig().with_overrides(overrides)
        cls = HybridDecodePipeline if kind == "hybrid" else (
            BatchedDecodePipeline if device.type == "cpu" else GpuDecodePipeline)
        return cls(cfg, samples, rank=0, world_size=1, device=device, stream_priority=priority)

    runs = [("pipeline", n, None, f"pipeline w{n}") for n in workers]
    runs += [("hybrid", args.hybrid_workers, f, f"hybrid{round(100 * f)} w{args.hybrid_workers}") for f in fractions]
    for kind, n, fraction, name in runs:
        pipe = pipeline(kind, n, fraction)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        record(measure_pipeline(pipe, name, args, device, workers=n))
        pipe.close()

    if args.train:
        trainer = Trainer(args, device, channels_last)
        record(trainer.measure("train synthetic", trainer.synthetic()))
        w = workers[-1]
        for priority in (-1, 0):
            pipe = pipeline("pipeline", w, priority=priority)
            record(trainer.measure(f"train+pipeline w{w}{'' if priority < 0 else ' prio0'}", epochs(pipe)))
            pipe.close()
        for f in fractions:
            pipe = pipeline("hybrid", args.hybrid_workers, f)
            record(trainer.measure(f"train+hybrid{round(100 * f)} w{args.hybrid_workers}", epochs(pipe)))
            pipe.close()

    table = [f"{'stage':<26}{'imgs/s':>9}{'ms/batch':>10}{'gpu ms':>8}{'busy ms':>9}{'cpu load':>10}"]
    for r in results:
        if r["stage"] == "checks":
            continue
        load = "" if r.get("cpu_load") is None else f"{100 * r['cpu_load']:.0f} %"
        gpu = "" if r.get("gpu_ms") is None else f"{r['gpu_ms']:.1f}"
        busy = "" if r.get("gpu_busy_ms") is None else f"{r['gpu_busy_ms']:.1f}{'*' if r.get('gate_short') else ''}"
        table.append(f"{r['stage']:<26}{r['imgs_per_s']:>9,.0f}{r['ms_per_batch']:>10.1f}{gpu:>8}{busy:>9}{load:>10}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(f"\n{env['device']}, torch {env['torch']}, batch {args.batch}, {env['mean_kb']} KB/JPEG, "
          f"{env['cpus']} CPUs")
    print("\n".join(table))
    for checks in (r for r in results if r["stage"] == "checks"):
        print(f"{checks['stage']}: " + ", ".join(f"{k}={v}" for k, v in checks.items()
                                                 if k not in ("stage", "imgs_per_s", "ms_per_batch", "cpu_load")))
    return 0


def epochs(pipe):
    """The pipeline's batches, epoch after epoch, as the training loop sees them."""
    epoch = 0
    while True:
        pipe.set_epoch(epoch)
        yield from pipe
        epoch += 1


def measure_pipeline(pipe, name, args, device, *, workers) -> dict:
    """Images/s the pipeline hands a consumer that does nothing else; epochs roll over as training's would."""
    n, t0, load, warm = 0, None, None, 3
    for _ in epochs(pipe):
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
                     "workers": workers}
                if device.type == "cuda":
                    r["peak_mem_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                return r


class Trainer:
    """A one-GPU training loop like trainer/loop.py's (autocast, GradScaler for fp16, fused SGD, channels_last),
    without DDP: what the pipeline costs the model on the same GPU and in the same process."""

    def __init__(self, args, device, channels_last):
        import torchvision

        self.args, self.device = args, device
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.model = torchvision.models.get_model(args.model, num_classes=1000).to(device, memory_format=fmt)
        self.fmt = fmt
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, **fused)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
        self.scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    def synthetic(self):
        g = torch.Generator().manual_seed(0)
        images = torch.randn(self.args.batch, 3, self.args.size, self.args.size, generator=g)
        images = images.to(self.device, memory_format=self.fmt)
        labels = torch.randint(0, 1000, (self.args.batch,), generator=g).to(self.device)
        while True:
            yield images, labels

    def step(self, images, labels):
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)
        with autocast:
            loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def measure(self, name, batches, warmup: int = 8) -> dict:
        for _ in range(warmup):
            self.step(*next(batches))
        sync(self.device)
        load, steps, t0 = CpuLoad(), 0, time.perf_counter()
        while True:
            self.step(*next(batches))
            steps += 1
            if steps % 4 == 0:
                sync(self.device)
                if time.perf_counter() - t0 >= self.args.seconds:
                    break
        elapsed = time.perf_counter() - t0
        batches.close()
        return {"stage": name, "imgs_per_s": round(steps * self.args.batch / elapsed, 1),
                "ms_per_batch": round(1000 * elapsed / steps, 3), "batches": steps, "cpu_load": load.stop(),
                "model": self.args.model, "precision": self.args.precision}


if __name__ == "__main__":
    raise SystemExit(main())
