"""`autotune show`: a study as a table — every trial, its throughput and its gain over trial 0."""

from __future__ import annotations

from autotune.cli import command


def arguments(p) -> None:
    p.add_argument("--study", help="study name (default: the only study in the storage)")
    p.add_argument("--storage", help="SQLAlchemy URL (default: sqlite:///studies/<study>.db)")
    p.add_argument("--sort", choices=["number", "imgs"], default="number", help="row order (default: number)")
    p.add_argument("--top", type=int, help="only the N fastest trials")


def table(study, sort: str = "number", top: int | None = None) -> str:
    from autotune.export import feasible
    from autotune.progress import fmt_duration, fmt_ips, fmt_params

    trials = study.get_trials(deepcopy=False)
    ok = feasible(study)
    base = next((t for t in ok if t.user_attrs.get("baseline")), None)
    base_ips = float(base.user_attrs["imgs_per_s"]) if base else None
    best = max(ok, key=lambda t: t.user_attrs["imgs_per_s"]) if ok else None
    if sort == "imgs" or top:
        trials = sorted(trials, key=lambda t: -(t.user_attrs.get("imgs_per_s") or -1))
    if top:
        trials = trials[:top]
    rows = [("#", "state", "imgs/s", "vs #0", "spread", "loss", "util", "wall", "params / outcome")]
    for t in trials:
        a = t.user_attrs
        state = t.state.name.lower()
        if a.get("failure_class"):
            state = ("infeasible" if a.get("constraint", 0) > 0 else "fail") + f":{a['failure_class']}"
        ips = a.get("imgs_per_s")
        gain = f"{ips / base_ips:.2f}x" if ips is not None and base_ips and t in ok else ""
        mark = "*" if best is not None and t.number == best.number else ""
        note = fmt_params(dict(t.params), 90)
        if a.get("baseline"):
            note = "(baseline) " + note
        elif a.get("start") is not None:
            note = f"(start {a['start']}) " + note
        rows.append((f"{t.number}{mark}", state, fmt_ips(ips) if ips is not None else "-", gain,
                     f"{a['spread']:.1%}" if a.get("spread") is not None else "-", fmt_loss(a),
                     f"{a['util_mean']:.0f}%" if a.get("util_mean") is not None else "n/a",
                     fmt_duration(a.get("wall_s")) if a.get("wall_s") is not None else "-", note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.rjust(w) if i in (2, 3, 4, 5, 6, 7) else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r[:-1], widths))) + "  " + r[-1] for r in rows]
    summary = f"study {study.study_name}: {len(study.get_trials(deepcopy=False))} trials, {len(ok)} measured"
    if best is not None:
        summary += f"; fastest #{best.number} {fmt_ips(best.user_attrs['imgs_per_s'])} imgs/s"
        if base_ips:
            summary += f" = {best.user_attrs['imgs_per_s'] / base_ips:.2f}x trial {base.number}"
    return "\n".join([summary, *lines, *trial_time(study.get_trials(deepcopy=False))])


def fmt_loss(attrs) -> str:
    """The loss over the measured windows, start -> end; "diverged" when it did not stay finite: a figure without
    its loss says nothing about training."""
    if attrs.get("loss_finite") is False:
        return "diverged"
    start, end = attrs.get("loss_start"), attrs.get("loss_end")
    if end is None:
        return "-"
    return f"{start:.3g}->{end:.3g}" if start is not None else f"{end:.3g}"


TIME_PARTS = (("launch_s", "launch"), ("warmup_s", "warm-up"), ("setup_s", "of it setup"),
              ("first_step_s", "first step"), ("settle_s", "discarded steps"), ("measure_s", "windows"))


def trial_time(trials) -> list[str]:
    """Where a launched trial's time goes, as medians: the lever for shorter trials (and so more of them)."""
    import statistics

    launched = [dict(t.user_attrs) for t in trials if t.user_attrs.get("launch_s") is not None]
    if not launched:
        return []
    for a in launched:  # the steps discarded after the first one (trials recorded before the split have none)
        if all(a.get(k) is not None for k in ("warmup_s", "setup_s", "first_step_s")):
            a["settle_s"] = a["warmup_s"] - a["setup_s"] - a["first_step_s"]
    parts = []
    for key, name in TIME_PARTS:
        values = [float(a[key]) for a in launched if a.get(key) is not None]
        if values:
            parts.append(f"{name} {statistics.median(values):.1f} s")
    wall = statistics.median(float(a["wall_s"]) for a in launched)
    return [f"median launched trial ({len(launched)}): {wall:.1f} s; medians of its parts: {', '.join(parts)}"]


@command("show", help="print a study's trials as a table, with the gain over trial 0", arguments=arguments)
def run(args) -> int:
    from autotune import study as study_mod

    study = study_mod.load(args.study, study_mod.resolve_storage(args.study, args.storage))
    print(table(study, args.sort, args.top))
    return 0
