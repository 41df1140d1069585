"""`autotune report`: the study as one self-contained plotly HTML page (opens offline)."""

from __future__ import annotations

import argparse

from autotune.cli import command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help="study name (default: the only study in the storage)")
    p.add_argument("--storage", help="SQLAlchemy URL (default: the file under studies/ that holds the study)")
    p.add_argument("--out", default="report.html", help="HTML file to write (default: report.html)")


@command("report", help="write the study as one self-contained HTML page of plots (history, importances, imgs/s "
                        "vs utilization, each figure's interval, failures, Pareto front)", arguments=arguments)
def run(args) -> int:
    from autotune.formatting import plural
    from autotune.outputs import check_output
    from autotune.report import trial_rows, write_report
    from autotune.study.storage import display_url, load, resolve_storage

    url = resolve_storage(args.study, args.storage)
    study = load(args.study, url)  # never creates a database: a missing file is an error
    made = check_output(args.out, "--out")
    if made is not None:
        print(f"autotune: making folder {made} for the report", flush=True)
    out = write_report(study, args.out, storage_url=display_url(url),  # no password in the page
                       storage_arg=display_url(args.storage) if args.storage else None)
    rows = trial_rows(study)
    print(f"autotune: report of study {study.study_name} ({plural(len(rows), 'trial')}) written to {out} "
          f"({out.stat().st_size / 2**20:.1f} MiB, self-contained; open it in a browser)")
    return 0
