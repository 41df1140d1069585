"""`autotune report`: one self-contained HTML page, every section present, and it renders in headless Chromium.

The studies here are real Optuna studies in SQLite whose trials carry the user attrs `autotune search` writes (a real
search's report is checked in test_train_cmd.py, which already runs one).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from tests.helpers.cli import autotune

DIST = {"training.batch_size": CategoricalDistribution([64, 128, 256]),
        "training.precision": CategoricalDistribution(["fp32", "bf16", "fp16"]),
        "data.decode": CategoricalDistribution(["pil", "torchvision-cpu", "nvjpeg-gpu"]),
        "ddp.bucket_cap_mb": FloatDistribution(5, 100, log=True)}

# (state, params, imgs/s windows, util, failure class) — the shape of a small GPU study, trial 0 the baseline.
TRIALS = [
    ("ok", (64, "fp32", "pil", 25.0), [1650, 1681, 1700], 59.0, None),
    ("ok", (256, "bf16", "torchvision-cpu", 40.0), [3150, 3204, 3230], 46.0, None),
    ("ok", (256, "bf16", "nvjpeg-gpu", 60.0), [7100, 7146, 7180], 91.0, None),
    ("ok", (256, "fp16", "nvjpeg-gpu", 30.0), [8500, 8625, 8700], 88.0, None),
    ("ok", (128, "fp32", "torchvision-cpu", 10.0), [2000, 2300, 2150], 70.0, None),
    ("infeasible", (256, "fp32", "nvjpeg-gpu", 20.0), [], None, "oom"),
    ("fail", (128, "bf16", "pil", 15.0), [], None, "nccl"),
    ("fail", (64, "fp16", "pil", 50.0), [], None, "hang"),
    ("pruned", (128, "fp16", "torchvision-cpu", 80.0), [900, 950], 40.0, None),
]


def make_study(storage: str, name: str = "gpu-study", *, pareto: bool = False, util: bool = True,
               trials=TRIALS, stages: bool = True, stage_trials=None, extra=None) -> optuna.Study:
    """``extra``: more attrs of some trials, by number."""
    study = optuna.create_study(study_name=name, storage=storage,
                                directions=["maximize", "maximize"] if pareto else ["maximize"])
    study.set_user_attr("objective", "pareto" if pareto else "throughput")
    study.set_user_attr("nproc_per_node", 2)
    study.set_user_attr("fingerprint", {"gpu_model": "NVIDIA H200", "gpu_count": 2, "driver": "580.00"})
    for number, (state, (bs, prec, dec, bucket), windows, u, cls) in enumerate(trials):
        params = {"training.batch_size": bs, "training.precision": prec, "data.decode": dec,
                  "ddp.bucket_cap_mb": bucket}
        attrs = {"log_path": f"studies/{name}/trial-{number}/log.txt", "util_available": util,
                 "config": {"training": {"precision": prec, "batch_size": bs}, "data": {"decode": dec}}}
        if number == 0:
            attrs["baseline"] = True
        if windows:
            med = sorted(windows)[len(windows) // 2]
            attrs.update(imgs_per_s=float(med), imgs_per_s_windows=[float(w) for w in windows],
                         ci_half_width=(max(windows) - min(windows)) / med / 2)
        if util:
            attrs["util_mean"] = u
        if cls:
            attrs.update(failure_class=cls, failure_message=f"rank 1: {cls} happened")
        attrs.update((extra or {}).get(number, {}))
        ips = attrs.get("imgs_per_s", 0.0)
        if state == "ok":
            attrs["constraint"] = 0.0
            values, st = ([ips, u] if pareto else [ips]), TrialState.COMPLETE
        elif state == "infeasible":
            attrs["constraint"] = 1.0
            values, st = ([0.0, 0.0] if pareto else [0.0]), TrialState.COMPLETE
        else:
            values, st = None, TrialState.PRUNED if state == "pruned" else TrialState.FAIL
        study.add_trial(create_trial(state=st, values=values, params=params, distributions=DIST, user_attrs=attrs))
    parts = optuna.create_study(study_name=f"{name}.parts", storage=storage, direction="maximize") if stages else None
    for stage, overrides, ips in (stage_trials or STAGE_TRIALS) if stages else ():
        attrs = {"stage": stage, "overrides": overrides, "imgs_per_s": ips, "imgs_per_s_windows": [ips],
                 "ci_half_width": 0.005,
                 "config": {"training": {"precision": overrides.get("training.precision", "bf16"),
                                         "batch_size": 256, "channels_last": True},
                            "data": {"decode": overrides.get("data.decode", "pil")}}}
        parts.add_trial(create_trial(state=TrialState.COMPLETE, values=[ips], user_attrs=attrs,
                                     system_attrs={"constraints:failed": 0.0}))
    return study


# Stage measurements (the model alone, each pipeline alone), recorded as the search records them: trials of the parts
# study, with no parameters.
STAGE_TRIALS = [("ceiling", {"training.precision": "fp16", "data.kind": "synthetic"}, 11645.0),
                ("supply", {"training.mode": "loader", "data.decode": "nvjpeg-gpu"}, 17632.0),
                ("supply", {"training.mode": "loader", "data.decode": "pil"}, 4126.0)]


def unescaped(page: str) -> str:
    """The page with plotly's JSON \\uXXXX escapes (it writes "/" and "·" so) turned back into characters."""
    return re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), page)


def report(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    return autotune("report", *args, cwd=tmp_path, timeout=120)


def test_report_has_every_section_and_is_self_contained(tmp_path):
    storage = f"sqlite:///{tmp_path / 'gpu.db'}"
    make_study(storage)
    r = report(tmp_path, "--storage", storage, "--out", "out/report.html")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "12 trials" in r.stdout and "autotune: making folder out for the report" in r.stdout  # said, not silent
    page = (tmp_path / "out" / "report.html").read_text()
    # It opens with the three numbers: the ceiling, what each pipeline feeds, how close the best gets.
    head = page[page.index('<table class="summary">'):page.index("</table>")]
    assert head.index("what the GPUs can do") < head.index("what each input pipeline can feed") < \
        head.index("the tuned configuration") < head.index("study")
    assert "11,645" in head and "nvjpeg-gpu 17,632" in head
    assert "trial 3, 8,625 ± 1.2 % imgs/s = 74% of the ceiling, 5.13x ± 1.9 % trial 0 (the baseline, 1,681 ± 1.5 %)" \
        in head
    for div in ("bottleneck", "history", "importances", "parallel", "util", "intervals", "failures"):
        assert f'id="plot-{div}"' in page, div
    assert 'id="empty-pareto"' in page and "single-objective" in page
    # Offline: plotly.js is inlined, nothing is fetched.
    assert not re.findall(r"<script[^>]*\ssrc=", page) and not re.findall(r"<link[^>]*\shref=", page)
    assert len(page) > 3_000_000 and page.count("Plotly.newPlot(") >= 6
    # The utilization caption states the design figure as such; the scatter groups precision x decode.
    assert "docs/benchmarks.md" in page and "ARCHITECTURE.md" not in page  # the figures are in the benchmarks
    for group in ("bf16 · nvjpeg-gpu", "fp16 · nvjpeg-gpu", "fp32 · pil", "bf16 · torchvision-cpu"):
        assert group in unescaped(page)
    assert "Optimization history" in page and "Best Value" in page
    assert "Parameter importances" in page and "Parallel coordinates" in page
    # Failures: counted by class and listed with their message and log.
    assert "Failed trials by class (3 of 12; 1 pruned)" in page
    assert "rank 1: oom happened" in page and "studies/gpu-study/trial-7/log.txt" in page
    assert "fastest" in page and "5.13x ± 1.9 % trial 0" in page  # 8625 / 1681, with both intervals
    # Before all that, what to do: what limits the job, the tuned settings, the commands, how sure the figure is.
    first = re.sub(r"<[^>]+>", "", page[page.index('<section id="conclusions">'):page.index("</section>")])
    assert page.index('<section id="conclusions">') < page.index('<table class="summary">')
    # 8,625 of the 11,645 the parts allow (74 %): the parts do not explain the gap, and no limit is named.
    assert ("what limits it: not explained by the parts: nvjpeg-gpu alone feeds 17,632 imgs/s and the model alone "
            "runs 11,645 on the GPUs, together allowing 11,645, and the tuned configuration reaches 8,625, 74% of "
            "that") in first
    assert "its settings: trial 3: bs=256 fp16 nvjpeg-gpu bkt=30" in first
    assert f"run it: autotune export best.yaml --study gpu-study --storage {storage}" in first
    assert "how sure: ± 1.2 % (95 % interval)" in first


def test_pareto_study_gets_its_front(tmp_path):
    storage = f"sqlite:///{tmp_path / 'p.db'}"
    make_study(storage, "pareto-study", pareto=True)
    r = report(tmp_path, "--study", "pareto-study", "--storage", storage, "--out", "p.html")
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "p.html").read_text()
    assert 'id="plot-pareto"' in page and "Pareto front" in page
    assert 'id="plot-history"' in page and "Best imgs/s so far" in unescaped(page)


def test_sections_without_data_say_so(tmp_path):
    from autotune.report import render_html

    storage = f"sqlite:///{tmp_path / 'cpu.db'}"
    few = list(TRIALS[:2])
    study = make_study(storage, "cpu-study", util=False, trials=few, stages=False)
    page = render_html(study)
    assert 'id="empty-util"' in page and "utilization is recorded as unavailable" in page
    assert 'id="empty-importances"' in page and "Too few feasible completed trials" in page
    assert 'id="empty-failures"' in page and "No trial failed" in page
    assert 'id="plot-history"' in page and 'id="plot-intervals"' in page

    # A trial still running (another search worker) neither breaks the page nor renumbers the trials after it.
    running = study.ask()
    running.set_user_attr("owner_pid", 1)
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[2500.0], params={"training.batch_size": 128},
                                 distributions={"training.batch_size": DIST["training.batch_size"]},
                                 user_attrs={"imgs_per_s": 2500.0, "imgs_per_s_windows": [2500.0],
                                             "ci_half_width": 0.01}))
    from autotune.report import plot_study, trial_rows

    rows = trial_rows(study)
    assert [r.outcome for r in rows] == ["measured", "measured", "running", "measured"]
    assert [t.number for t in plot_study(study, rows, feasible_only=False).trials] == [0, 1, 2, 3]
    assert 'id="plot-history"' in render_html(study)

    empty = optuna.create_study(study_name="empty", storage=storage)
    page = render_html(empty)
    assert page.count('class="empty"') == len(("bottleneck", "history", "importances", "parallel", "util",
                                               "intervals", "failures", "pareto"))


def test_a_cpu_study_speaks_of_cpu_ranks_and_the_interval_plot_draws_its_end_to_end_trials(tmp_path):
    from autotune.report import build_sections

    study = make_study(f"sqlite:///{tmp_path / 'cpu.db'}", "cpu-study", util=False, trials=TRIALS[:2])
    study.set_user_attr("fingerprint", {"gpu_count": 0, "cpu_count": 2})
    # A stage measurement with a wider interval than any end-to-end trial's: it has no bar in the interval plot.
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[300.0], system_attrs={
        "constraints:measures_a_part": 1.0}, user_attrs={"stage": "supply", "imgs_per_s": 300.0,
                                                         "imgs_per_s_windows": [200.0, 300.0, 400.0],
                                                         "ci_half_width": 0.3,
                                                         "overrides": {"training.mode": "loader"}}))
    _, sections = build_sections(study)
    by = {s.id: s for s in sections}
    assert "what the CPU ranks compute (the ceiling)" in by["bottleneck"].caption and "GPU" not in \
        by["bottleneck"].caption
    drawn = {x for trace in by["intervals"].figure.data for x in trace.x}
    assert drawn == {"#0", "#1"} and list(by["intervals"].figure.layout.xaxis.categoryarray) == ["#0", "#1"]
    bars = [y for trace in by["intervals"].figure.data for y in trace.error_y.array]
    assert all(b > 0 for b in bars)  # each figure with its interval
    assert "Widest: trial 0, ± 1.5%." in by["intervals"].caption  # (1700 - 1650) / 1681 / 2, not the supply's 30 %


def test_what_limits_the_job_is_the_smaller_of_the_ceiling_and_its_pipelines_supply(tmp_path):
    from autotune.overview import conclusions

    slow_feed = [STAGE_TRIALS[0], ("supply", {"training.mode": "loader", "data.decode": "nvjpeg-gpu"}, 9000.0)]
    study = make_study(f"sqlite:///{tmp_path / 'feed.db'}", stage_trials=slow_feed)
    limit = dict(conclusions(study))["what limits it"]
    assert limit == ("the input pipeline: nvjpeg-gpu alone feeds 9,000 imgs/s, less than the model alone computes on "
                     "the GPUs (11,645); the tuned configuration reaches 8,625, 96% of that")
    none = make_study(f"sqlite:///{tmp_path / 'none.db'}", "plain", stages=False)
    assert dict(conclusions(none))["what limits it"].startswith("not measured: this study has no stage measurements")


@pytest.mark.parametrize(("share", "says"), [
    (0.31, "its step waits 31 % of its measured time for data: the input side holds it back"),
    (0.02, "its step waits 2 % of its measured time for data: the step itself runs slower than the model alone"),
])
def test_a_gap_the_parts_do_not_explain_is_split_by_the_best_steps_wait_for_data(tmp_path, share, says):
    """Trial 3 reaches 74 % of what its parts allow: what limits it says where its step's time went, as its run
    measured it, in ``show`` and the report alike; the settings' line does not say it again."""
    from autotune.overview import conclusions, table

    study = make_study(f"sqlite:///{tmp_path / 'gap.db'}", extra={3: {"data_wait_share": share}})
    said = dict(conclusions(study))
    assert said["what limits it"].startswith("not explained by the parts") and says in said["what limits it"]
    assert "profile_step" not in said["what limits it"] and "for data" not in said["its settings"]
    assert f"what limits it: {said['what limits it']}" in table(study).splitlines()
    # A study whose runs did not time their waits reads as it did: where to look.
    unknown = dict(conclusions(make_study(f"sqlite:///{tmp_path / 'old.db'}", "old")))["what limits it"]
    assert unknown.endswith("something else holds it back (the loader and the job contending for the CPU, a slow "
                            "step the parts do not run); bench/profile_step.py shows where a step's time goes")


def test_a_gap_whose_step_was_profiled_is_said_by_its_largest_cost_and_what_addresses_it(tmp_path):
    """Trial 3, not explained by its parts, had its step profiled (``step_split``): ``show`` and the report say its
    largest cost beyond the model's own forward and backward, with what addresses it, then the other parts; a part
    the profile could not measure (CPU ranks: the copy, the launch gaps) is said to be not measured, never 0."""
    from autotune.overview import conclusions, table
    from autotune.report import render_html
    from autotune.study.measured import STEP_PARTS
    from trainer.profile import PARTS

    split = {"data": 0.31, "copy": None, "compute": 0.52, "optimizer": 0.04, "communication": 0.08, "launch": None,
             "steps": 10, "seconds": 1.2, "rank": 1}
    study = make_study(f"sqlite:///{tmp_path / 'gap.db'}", extra={3: {"data_wait_share": 0.3, "step_split": split}})
    said = dict(conclusions(study))["what limits it"]
    assert said.startswith("not explained by the parts"), said
    assert ("a profile of trial 3's step over 10 steps: it waits 31 % of its time for data, the largest cost: more "
            "loader workers where the CPU has cores to spare, fewer where they crowd the rank's own process") in said
    assert ("then forward and backward 52 %, the optimizer 4 %, DDP's communication 8 %; the host-to-device copy and "
            "the host's launch gaps not measured") in said
    assert f"what limits it: {said}" in table(study).splitlines()
    assert "a profile of trial 3&#x27;s step over 10 steps: it waits 31 % of its time for data" in render_html(study)
    assert "where its step goes" not in dict(conclusions(study))  # said once
    # Where the parts explain the job, the profile is a line of its own; a step that is its own work (every other
    # part below the data-wait threshold) names forward and backward.
    own = {**split, "data": 0.02, "communication": 0.05, "optimizer": 0.03, "compute": 0.85}
    slow_feed = [STAGE_TRIALS[0], ("supply", {"training.mode": "loader", "data.decode": "nvjpeg-gpu"}, 9000.0)]
    fed = make_study(f"sqlite:///{tmp_path / 'feed.db'}", "fed", stage_trials=slow_feed, extra={3: {"step_split": own}})
    lines = dict(conclusions(fed))
    assert lines["what limits it"].startswith("the input pipeline")
    assert lines["where its step goes"].startswith("a profile of trial 3's step over 10 steps: it spends 85 % of its "
                                                   "time in forward and backward, the largest cost: the batch")
    assert list(STEP_PARTS) == list(PARTS)  # one entry per part the profile measures
    # Where the run's cores were read, they say which way the workers go.
    full = make_study(f"sqlite:///{tmp_path / 'full.db'}", "full",
                      extra={3: {"data_wait_share": 0.3, "step_split": split, "cpu_busy": 0.98}})
    assert ("it waits 31 % of its time for data, the largest cost: fewer loader workers (its cores were 98 % busy: "
            "more workers would crowd the rank's own process)") in dict(conclusions(full))["what limits it"]
    room = make_study(f"sqlite:///{tmp_path / 'room.db'}", "room", extra={3: {"data_wait_share": 0.3,
                                                                               "cpu_busy": 0.41}})
    said = dict(conclusions(room))["what limits it"]
    assert ("its step waits 30 % of its measured time for data: the input side holds it back — more loader workers "
            "or batches in flight (its cores were 41 % busy: they have room)") in said, said
    # A profile that failed says why, and what limits it falls back on the run's own split.
    failed = {**dict.fromkeys(PARTS), "error": "RuntimeError: no CUPTI", "steps": 10, "seconds": 1.0, "rank": 0}
    broken = make_study(f"sqlite:///{tmp_path / 'broken.db'}", "broken",
                        extra={3: {"data_wait_share": 0.3, "step_split": failed}})
    lines = dict(conclusions(broken))
    assert lines["where its step goes"] == "trial 3's step could not be profiled (RuntimeError: no CUPTI)"
    assert "its step waits 30 % of its measured time for data" in lines["what limits it"]


def test_the_best_steps_wait_for_data_is_on_its_settings_line_where_what_limits_it_does_not_say_it(tmp_path):
    from autotune.overview import conclusions

    slow_feed = [STAGE_TRIALS[0], ("supply", {"training.mode": "loader", "data.decode": "nvjpeg-gpu"}, 9000.0)]
    study = make_study(f"sqlite:///{tmp_path / 'feed.db'}", stage_trials=slow_feed,
                       extra={3: {"data_wait_share": 0.004}})
    said = dict(conclusions(study))
    assert said["what limits it"].startswith("the input pipeline") and "for data" not in said["what limits it"]
    assert said["its settings"] == ("trial 3: bs=256 fp16 nvjpeg-gpu bkt=30; its step waits less than 1 % of its "
                                    "measured time for data")


def test_a_ceiling_the_tuned_configuration_ran_above_is_not_named_what_limits_it(tmp_path):
    """CPU ranks, a ceiling measured at batch 128 only, the tuned configuration at batch 512 faster than it: "what
    limits it: the model's compute ...: 35,755 samples/s ...; the tuned configuration reaches 50,829, 142% of that"
    (the headline above it said the ceiling bounds nothing at those settings)."""
    from autotune.overview import conclusions

    low = [("ceiling", {"training.precision": "fp16", "data.kind": "synthetic"}, 6000.0), STAGE_TRIALS[1]]
    study = make_study(f"sqlite:///{tmp_path / 'low.db'}", stage_trials=low)
    limit = dict(conclusions(study))["what limits it"]
    assert "% of that" not in limit and "of it" not in limit, limit
    assert "above what they allow" in limit and "bounds nothing at its settings" in limit, limit


def test_missing_study_is_one_line(tmp_path):
    r = report(tmp_path, "--study", "nope")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "autotune search" in r.stderr
    r = report(tmp_path, "--storage", "sqlite:///nope.db")
    assert r.returncode == 2 and "no such database" in r.stderr and not (tmp_path / "nope.db").exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (CI installs it)")
def test_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image, ImageStat

    storage = f"sqlite:///{tmp_path / 'gpu.db'}"
    make_study(storage)
    html = tmp_path / "report.html"
    r = report(tmp_path, "--storage", storage, "--out", str(html))
    assert r.returncode == 0, r.stderr
    png = tmp_path / "shot.png"
    shot = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
                           "--window-size=1400,3000", "--virtual-time-budget=5000", html.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert png.is_file(), shot.stderr[-2000:]
    img = Image.open(png).convert("RGB")
    assert img.size == (1400, 3000)
    assert max(ImageStat.Stat(img.convert("L")).stddev) > 20  # not a blank page
    # Text alone is grey; plotted markers, lines and bars are coloured: the JavaScript drew the figures.
    hsv = np.asarray(img.convert("HSV"))
    saturated = int(((hsv[..., 1] > 100) & (hsv[..., 2] > 80)).sum())
    assert saturated > 0.005 * img.size[0] * img.size[1], saturated
    # The captions came through, not a script error page.
    assert re.search(r"Optimization history", html.read_text())


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (CI installs it)")
def test_the_reports_first_screen_says_what_limits_the_job_what_to_run_and_how_sure(tmp_path):
    """What a reader sees before scrolling, as Chromium lays the page out on a laptop's screen."""
    storage = f"sqlite:///{tmp_path / 'gpu.db'}"
    make_study(storage)
    html = tmp_path / "report.html"
    assert report(tmp_path, "--storage", storage, "--out", str(html)).returncode == 0
    # The text of every text node whose box starts above the viewport's bottom edge, once the page has loaded.
    probe = ("<script>window.addEventListener('load', () => { const w = document.createTreeWalker(document.body, "
             "NodeFilter.SHOW_TEXT); const seen = []; let n; while ((n = w.nextNode())) { const r = "
             "document.createRange(); r.selectNodeContents(n); const b = r.getBoundingClientRect(); "
             "if (b.height > 0 && b.top < window.innerHeight && n.textContent.trim()) seen.push(n.textContent); } "
             "const pre = document.createElement('pre'); pre.id = 'first-screen'; pre.textContent = seen.join(' '); "
             "document.body.appendChild(pre); });</script>")
    probed = tmp_path / "probed.html"
    probed.write_text(html.read_text().replace("</body>", probe + "</body>"))
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                          "--no-first-run", "--disable-background-networking", "--disable-component-update",
                          "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1366,768",
                          "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="first-screen">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stderr[-2000:]
    first = " ".join(found.group(1).replace("&amp;", "&").replace("&#x27;", "'").split())
    assert "the tuned configuration: trial 3, 8,625 ± 1.2 % imgs/s = 74% of the ceiling" in first, first
    assert "what limits it: not explained by the parts" in first
    assert "its settings: trial 3: bs=256 fp16 nvjpeg-gpu bkt=30" in first
    assert f"run it: autotune export best.yaml --study gpu-study --storage {storage}" in first
    assert "then autotune train --config best.yaml" in first
    assert "how sure: ± " in first and "fresh process" in first
    assert "Parallel coordinates" not in first  # far below: the probe does see only the first screen


def test_a_study_in_another_unit_is_reported_in_it(tmp_path):
    """A user's script that counts tokens: every figure of its report said imgs/s (its axes, its lines, its hover
    texts, the fastest trial's row)."""
    from autotune.report import render_html

    study = make_study(f"sqlite:///{tmp_path / 't.db'}", "lm", pareto=True)
    study.set_user_attr("unit", "tokens")
    page = unescaped(render_html(study))
    assert "imgs/s" not in page, [page[max(0, i - 80):i + 20] for i in range(len(page)) if page.startswith("imgs/s", i)]
    assert "Best tokens/s so far" in page and "tokens/s (global)" in page


def test_the_trials_time_line_counts_the_trials_whose_loader_workers_an_earlier_trial_kept():
    from autotune.overview import trial_time
    from autotune.study.view import TrialView

    def ran(number: int, **attrs) -> TrialView:
        return TrialView(number=number, state=TrialState.COMPLETE, stage="climb", outcome="measured",
                         imgs_per_s=100.0, half_width=0.02, params={},
                         attrs={"launch_s": 0.1, "wall_s": 10.0, "worker": "worker-1", **attrs})

    trials = [ran(0, fresh_process="trial 0 runs as the user's job does"), ran(1), ran(2, loader_kept=True),
              ran(3, loader_kept=True)]
    assert trial_time(trials)[0].startswith("median trial (1 launched, 3 on a live worker, 2 of them with the loader "
                                            "workers an earlier trial kept): 10.0 s")
    assert trial_time(trials[:2])[0].startswith("median trial (1 launched, 1 on a live worker): ")
