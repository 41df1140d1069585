"""ImageNet-like JPEG folders for benchmarks and tests (behind ``autotune make-data``).

What matters for an input-pipeline benchmark is that decoding costs what it costs on real photos: ImageNet's JPEGs
are ~300-500 px per side and ~110 KB, and a JPEG's size (its entropy-coded payload) is what the decoder spends time
on. Flat colours compress to a few KB and decode far too fast; pure noise decodes slowly but is nothing a model can
learn. So each image is smooth multi-scale colour fields, a gradient and a few blurred shapes (coloured per class,
so a model has something to learn), plus fine texture and grain whose amplitude is chosen per image to land on a
target file size drawn from 60-120 KB.

Generation is deterministic in ``seed`` (each image has its own random stream, so the worker count does not matter),
runs on all cores, and is idempotent: a manifest written last marks a complete folder, and a second call with the
same arguments reuses it ("make once and cache"). An interrupted run resumes: files are written under a temporary
name and renamed, so every ``.jpg`` present is complete and is kept.

Only numpy and PIL (both already needed by torchvision); no torch, so ``autotune make-data`` starts fast.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MANIFEST = "autotune-data.json"
GENERATOR = "autotune-jpeg/1"
"""Bumped whenever the pixels change, so a cached folder made by older code is not mistaken for a current one."""

_SIDE_LONG = (380, 500)
_SIDE_SHORT_MIN = 300
_TARGET_KB = (62.0, 116.0)
_TILE = 1024
# Bits per pixel of the JPEG (quality 90) against the texture/grain amplitude `detail`, measured on this generator's
# images; inverted per image with np.interp to hit its target size. Capped at 64: beyond it the image is mostly grain.
_DETAIL = (3, 5, 8, 12, 16, 20, 24, 32, 40, 48, 56, 64)
_BPP = (1.56, 1.92, 2.47, 3.12, 3.64, 4.05, 4.39, 4.96, 5.45, 5.86, 6.18, 6.44)


class DatagenError(ValueError):
    """Bad arguments or a folder that cannot be (re)used; the message is one line naming the fix."""


@dataclass(kw_only=True)
class DatagenSpec:
    """Everything that determines the folder's content; stored in the manifest and compared on reuse."""

    images: int
    """Total JPEGs, training plus validation."""

    classes: int
    """Class sub-folders; image ``i`` belongs to class ``i % classes``."""

    val_fraction: float = 0.0
    """Share of the images written under ``val/`` instead of ``train/`` (every class gets some)."""

    seed: int = 0
    quality: int = 90
    """JPEG quality; the 60-120 KB sizes are calibrated for 90."""

    generator: str = GENERATOR

    @property
    def val_count(self) -> int:
        return round(self.images * self.val_fraction)

    def problems(self) -> list[str]:
        p = []
        if self.images < 1:
            p.append(f"images={self.images}: must be >= 1")
        if self.classes < 1:
            p.append(f"classes={self.classes}: must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            p.append(f"val_fraction={self.val_fraction}: must be in [0, 1)")
        if not 1 <= self.quality <= 100:
            p.append(f"quality={self.quality}: must be in 1..100")
        if p:
            return p
        train, val = self.images - self.val_count, self.val_count
        # ImageFolder refuses a class folder without files, and train/val must list the same classes.
        if train < self.classes:
            p.append(f"{train} training images for {self.classes} classes: every class needs at least one; "
                     f"raise images or lower classes/val_fraction")
        if self.val_fraction > 0 and val < self.classes:
            p.append(f"val_fraction={self.val_fraction} gives {val} validation images for {self.classes} classes: "
                     f"every class needs at least one; raise images or val_fraction")
        return p


def class_name(c: int) -> str:
    return f"c{c:04d}"


def image_path(root: Path, spec: DatagenSpec, i: int) -> Path:
    split = "val" if i >= spec.images - spec.val_count else "train"
    return root / split / class_name(i % spec.classes) / f"{i:08d}.jpg"


def make_image_folder(root: str | os.PathLike, *, images: int, classes: int, val_fraction: float = 0.0, seed: int = 0,
                      workers: int | None = None, progress: bool = True, quality: int = 90) -> dict:
    """Write ``root/train/<class>/*.jpg`` (and ``root/val/<class>/*.jpg`` when ``val_fraction > 0``), or reuse the
    folder if a previous call with the same arguments completed it. Returns a summary: counts, mean KB, mean size,
    images/s, and ``cached``."""
    spec = DatagenSpec(images=images, classes=classes, val_fraction=val_fraction, seed=seed, quality=quality)
    problems = spec.problems()
    if workers is not None and workers < 1:
        problems.append(f"workers={workers}: must be >= 1")
    if problems:
        raise DatagenError("; ".join(problems))
    root = Path(root)
    cached = _reusable(root, spec)
    if cached is not None:
        return {**cached, "cached": True}

    workers = min(workers or os.cpu_count() or 1, images)
    t0 = time.perf_counter()
    stats = np.zeros((images, 3), dtype=np.int64)  # bytes, width, height
    chunk = max(1, min(64, images // (workers * 8)))
    jobs = [(str(root), spec, i, min(i + chunk, images)) for i in range(0, images, chunk)]
    from tqdm import tqdm

    pool = None
    if workers > 1:
        import multiprocessing

        # Blocked while the workers start, so none can take a signal before _worker_signals has run in it.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
        try:
            pool = multiprocessing.get_context().Pool(workers, initializer=_worker_signals, initargs=(blocked,))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        with tqdm(total=images, unit="img", desc=f"make-data {root}", disable=not progress, dynamic_ncols=True) as bar:
            for start, rows in (pool.imap_unordered(_write_range, jobs) if pool else map(_write_range, jobs)):
                stats[start:start + len(rows)] = rows
                bar.update(len(rows))
    finally:
        if pool is not None:
            pool.terminate()  # idle once every result is in; on an error or Ctrl-C this stops the rest at once
            pool.join()
    seconds = time.perf_counter() - t0
    summary = {
        "root": str(root),
        "images": images,
        "train": images - spec.val_count,
        "val": spec.val_count,
        "classes": classes,
        "mean_kb": round(float(stats[:, 0].mean()) / 1024, 2),
        "min_kb": round(float(stats[:, 0].min()) / 1024, 2),
        "max_kb": round(float(stats[:, 0].max()) / 1024, 2),
        "mean_width": round(float(stats[:, 1].mean()), 1),
        "mean_height": round(float(stats[:, 2].mean()), 1),
        "seconds": round(seconds, 3),
        "images_per_s": round(images / seconds, 1),
        "workers": workers,
    }
    tmp = root / f".{MANIFEST}.{os.getpid()}.tmp"  # two processes making the same cached set must not collide
    tmp.write_text(json.dumps({"spec": asdict(spec), "summary": summary}, indent=1))
    os.replace(tmp, root / MANIFEST)
    return {**summary, "cached": False}


_WORKER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _worker_signals(mask) -> None:
    """A pool worker's signals: a forked worker inherits its parent's Python handlers (``autotune search`` turns
    SIGTERM and SIGHUP into an exception), and ``pool.terminate()`` SIGTERMs the workers, so each printed a
    traceback of its own when the parent was stopped. Here SIGTERM and SIGHUP end a worker at once, silently, and
    SIGINT (Ctrl-C reaches the whole process group) is the parent's to handle: it terminates the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _reusable(root: Path, spec: DatagenSpec) -> dict | None:
    """The stored summary if ``root`` is complete for ``spec``; None if it must be (re)made; an error if it is
    someone else's folder."""
    manifest = root / MANIFEST
    if manifest.is_file():
        try:
            stored = json.loads(manifest.read_text())
            same = stored["spec"] == asdict(spec)
        except (ValueError, KeyError, TypeError):
            raise DatagenError(f"{manifest}: unreadable manifest; delete {root} and run again") from None
        if not same:
            old = stored["spec"]
            raise DatagenError(
                f"{root} already holds a data set made with other arguments (images={old.get('images')}, "
                f"classes={old.get('classes')}, val_fraction={old.get('val_fraction')}, seed={old.get('seed')}, "
                f"quality={old.get('quality')}, {old.get('generator')}): choose another folder or delete it")
        if _count_files(root) != spec.images:
            raise DatagenError(f"{root}: files were added or removed since it was made; delete it and run again")
        return stored["summary"]
    if root.exists():
        if not root.is_dir():
            raise DatagenError(f"{root} exists and is not a folder: choose another path")
        foreign = sorted(p.name for p in root.iterdir() if p.name not in ("train", "val"))
        if foreign:
            raise DatagenError(f"{root} is not empty and was not made by make-data (holds {', '.join(foreign[:3])}"
                               f"{', ...' if len(foreign) > 3 else ''}): choose an empty or new folder")
    return None


def _count_files(root: Path) -> int:
    n = 0
    for split in ("train", "val"):
        if (root / split).is_dir():
            for cls in os.scandir(root / split):
                if cls.is_dir():
                    n += sum(1 for f in os.scandir(cls.path) if f.name.endswith(".jpg"))
    return n


# ---- one image ------------------------------------------------------------------------------------------------------

_noise_tiles: dict[int, np.ndarray] = {}


def _noise_tile(seed: int) -> np.ndarray:
    # Per-pixel Gaussian draws cost more than everything else together; a fixed tile per seed, sampled at a random
    # offset per image, is free and keeps the output independent of which worker made it.
    tile = _noise_tiles.get(seed)
    if tile is None:
        rng = np.random.default_rng([seed, 2])
        grain = rng.normal(0.0, 1.0, (_TILE, _TILE, 1)) * 0.8 + rng.normal(0.0, 0.6, (_TILE, _TILE, 3))
        tile = np.clip(grain * 32.0, -127, 127).astype(np.int8)  # sensor-like: mostly luminance, some chroma
        _noise_tiles[seed] = tile
    return tile


def _class_style(seed: int, c: int) -> dict:
    rng = np.random.default_rng([seed, 1, c])
    return {
        "base": rng.uniform(50, 205, 3),
        "accents": rng.uniform(0, 255, (3, 3)),
        "p_ellipse": float(rng.uniform(0.1, 0.9)),
        "tilt": float(rng.uniform(0, 2 * math.pi)),
    }


def _octave(rng: np.random.Generator, h: int, w: int, cell: float, channels: int = 3) -> np.ndarray:
    """A smooth random field varying on the scale of ``cell`` pixels, centred on 0, roughly in [-128, 128]."""
    from PIL import Image

    gh, gw = max(2, round(h / cell)) + 1, max(2, round(w / cell)) + 1
    shape = (gh, gw, channels) if channels == 3 else (gh, gw)
    small = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
    out = np.asarray(small.resize((w, h), Image.BICUBIC), dtype=np.float32) - 128.0
    return out if channels == 3 else out[..., None]


def render(seed: int, i: int, classes: int) -> np.ndarray:
    """Image ``i`` of the data set as HxWx3 uint8 (its size depends only on ``seed`` and ``i``)."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng([seed, 0, i])
    style = _class_style(seed, i % classes)
    long = int(rng.integers(_SIDE_LONG[0], _SIDE_LONG[1] + 1))
    short = max(_SIDE_SHORT_MIN, int(long * rng.uniform(0.66, 1.0)))
    h, w = (long, short) if rng.random() < 0.3 else (short, long)
    target_bpp = rng.uniform(*_TARGET_KB) * 8192 / (h * w)
    detail = float(np.interp(target_bpp, _BPP, _DETAIL))

    # The smooth part (colour fields and a gradient) is made at 1/8 scale and upsampled once: full-resolution float
    # arithmetic would triple the time per image for content that has no detail at that scale anyway.
    hs, ws = -(-h // 8), -(-w // 8)
    low = (style["base"] + rng.normal(0, 20, 3)).astype(np.float32)
    # Mostly light and shade, some hue change: independent channels at full strength make rainbows.
    low = low + _octave(rng, hs, ws, max(hs, ws) / 2.5, channels=1) * 0.45
    low += _octave(rng, hs, ws, max(hs, ws) / 2, channels=3) * 0.2 + _octave(rng, hs, ws, 5) * 0.2
    gy = np.linspace(-1, 1, hs, dtype=np.float32)[:, None, None]
    gx = np.linspace(-1, 1, ws, dtype=np.float32)[None, :, None]
    angle = style["tilt"] + rng.normal(0, 0.5)
    low += (math.cos(angle) * gx + math.sin(angle) * gy) * rng.uniform(10, 50, 3).astype(np.float32)
    pic = Image.fromarray(np.clip(low, 0, 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)

    draw = ImageDraw.Draw(pic)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        s = int(rng.integers(20, max(h, w) // 2))
        accent = style["accents"][int(rng.integers(0, 3))]
        colour = tuple(int(v) for v in np.clip(accent + rng.normal(0, 25, 3), 0, 255))
        if rng.random() < style["p_ellipse"]:
            draw.ellipse([x0, y0, x0 + s, y0 + int(s * rng.uniform(0.5, 1.5))], fill=colour)
        else:
            corners = int(rng.integers(3, 6))
            draw.polygon([(x0 + int(rng.integers(-s, s)), y0 + int(rng.integers(-s, s))) for _ in range(corners)],
                         fill=colour)
    pic = pic.filter(ImageFilter.BoxBlur(1))  # soft edges, as a lens makes them

    # Fine luminance texture plus colour grain: this is what gives the file its size (and the decoder its work).
    oy, ox = int(rng.integers(0, _TILE - h)), int(rng.integers(0, _TILE - w))
    out = _noise_tile(seed)[oy:oy + h, ox:ox + w].astype(np.float32)
    out *= detail / 64
    out += _octave(rng, h, w, 3, channels=1) * (detail / 40)
    out += np.asarray(pic, dtype=np.float32)
    np.clip(out, 0, 255, out=out)
    return out.astype(np.uint8)


def encode(pixels: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _write_range(job) -> tuple[int, np.ndarray]:
    root, spec, start, stop = job
    root = Path(root)
    rows = np.zeros((stop - start, 3), dtype=np.int64)
    for k, i in enumerate(range(start, stop)):
        path = image_path(root, spec, i)
        if path.is_file():  # left complete by an interrupted run (files only appear by rename)
            from PIL import Image

            with Image.open(path) as im:
                rows[k] = (path.stat().st_size, *im.size)
            continue
        pixels = render(spec.seed, i, spec.classes)
        data = encode(pixels, spec.quality)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        rows[k] = (len(data), pixels.shape[1], pixels.shape[0])
    return start, rows
