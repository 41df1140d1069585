"""`autotune show`: a study in words — ceiling, supplies and the tuned configuration first, then every trial."""

from __future__ import annotations

import argparse

from autotune.cli import command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help="study name (default: the only study in the storage)")
    p.add_argument("--storage", help="SQLAlchemy URL (default: the file under studies/ that holds the study)")
    p.add_argument("--sort", choices=["number", "imgs"], default="number", help="row order (default: number)")
    p.add_argument("--top", type=int, help="only the N fastest trials")


@command("show", help="print a study: what the GPUs can do, what each input pipeline can feed, how close the tuned "
                      "config gets, then every trial", arguments=arguments)
def run(args: argparse.Namespace) -> int:
    from autotune.overview import table
    from autotune.study.storage import display_url, load, resolve_storage

    study = load(args.study, resolve_storage(args.study, args.storage))
    print(table(study, args.sort, args.top, storage=display_url(args.storage) if args.storage else None))
    return 0
