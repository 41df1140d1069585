"""`autotune make-data DIR`: an ImageNet-like JPEG folder to benchmark and test input pipelines on."""

from __future__ import annotations

import argparse

from autotune.cli import command
from autotune.exceptions import DataError


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="folder to create (train/<class>/*.jpg, val/<class>/*.jpg)")
    p.add_argument("--images", type=int, required=True, help="total JPEGs, training plus validation")
    p.add_argument("--classes", type=int, required=True, help="class sub-folders")
    p.add_argument("--val-fraction", type=float, default=0.0, help="share of the images put under val/ (default 0)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same files (default 0)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90; sizes are calibrated for it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("make-data", help="write an ImageNet-like JPEG folder (reused when it already exists with the same arguments)",
         arguments=_arguments)
def run(args: argparse.Namespace) -> int:
    from trainer.datagen import DatagenError, make_image_folder

    try:
        s = make_image_folder(args.dir, images=args.images, classes=args.classes, val_fraction=args.val_fraction,
                              seed=args.seed, workers=args.workers, progress=not args.no_progress,
                              quality=args.quality)
    except DatagenError as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(f"{args.dir}: {e.strerror or e}: choose a writable folder") from None
    verb = "reused," if s["cached"] else f"made in {s['seconds']:.1f} s ({s['images_per_s']:.0f} imgs/s),"
    print(f"{s['root']}: {s['images']} JPEGs ({s['train']} train, {s['val']} val, {s['classes']} classes) {verb} "
          f"mean {s['mean_kb']:.0f} KB, mean {s['mean_width']:.0f}x{s['mean_height']:.0f} px")
    return 0
