"""Issue 28, "say the fix, not only the limit": where a user's script reads an image folder through a DataLoader of its
own and that loader bounds its job, the search measures the project's fastest pipeline alone on the same folder, once,
and ``show``, the report and the search's closing lines say both figures and the change to make.

The runtime's side (what it tells of a script's Dataset) runs in-process on real files (``tiny_jpegs``); the search's
side on the simulated machine of ``test_script_defects`` (the figures are inputs of the tests); the measurement's
config runs for real once, on a live worker of the example script ``examples/folder_ddp.py:main``."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision import datasets
from torchvision.transforms import v2

from autotune import overview
from autotune.study import view
from tests.autotune.search.test_script_defects import Sim, cpu_ranks, first_screen
from tests.helpers.cli import REPO
from trainer.runtime._folder import crop_size, image_folder

FOLDER = {"path": "/data/photos/train", "image_size": 176}


# ---- the runtime: what it tells of a script's own Dataset ----------------------------------------------------------


def transform(size):
    return v2.Compose([v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(), v2.ToImage(),
                       v2.ToDtype(torch.float32, scale=True)])


def test_an_imagefolder_of_jpegs_is_told_with_its_crop_and_nothing_else_is(tiny_jpegs, tmp_path):
    folder = datasets.ImageFolder(str(tiny_jpegs), transform=transform(32))
    classes = len(folder.classes)
    assert image_folder(folder) == {"path": str(tiny_jpegs.resolve()), "classes": classes, "image_size": 32}
    assert image_folder(datasets.ImageFolder(str(tiny_jpegs))) == {"path": str(tiny_jpegs.resolve()),
                                                                   "classes": classes}  # no crop
    assert crop_size(v2.Compose([v2.Resize(256), v2.CenterCrop(224)])) == 224
    assert crop_size(v2.RandomResizedCrop((160, 128))) is None  # not square: the pipelines crop squares
    # Not an image folder: no folder to read, and no measurement for it.
    assert image_folder(TensorDataset(torch.zeros(4, 3))) is None
    png = tmp_path / "png" / "a"
    png.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(png / "x.png")
    assert image_folder(datasets.ImageFolder(str(tmp_path / "png"))) is None  # the pipelines decode JPEGs


class _Records(list):
    def write(self, record, *, any_rank=False):
        self.append(record)

    def __bool__(self):
        return True


@pytest.mark.parametrize("wrapped", [False, True], ids=["dataset", "dataloader"])
def test_the_settings_record_names_the_folder_a_scripts_loader_reads(tiny_jpegs, wrapped):
    from trainer.records import Dist
    from trainer.runtime import setup
    from trainer.runtime.request import Active, Request, activate

    records = _Records()
    env = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    activate(Active(request=Request(mode="plain"), writer=records, env=env))
    try:
        run = setup(unit="images")
        data = datasets.ImageFolder(str(tiny_jpegs), transform=transform(24))
        loader = run.loader(DataLoader(data, batch_size=4) if wrapped else data, batch_size=4)
        images, _ = next(iter(loader))
        run.report(len(images))
        run.close()
    finally:
        activate(None)
    (settings,) = [r for r in records if r["kind"] == "settings"]
    assert settings["image_folder"] == {"path": str(tiny_jpegs.resolve()), "classes": len(data.classes),
                                        "image_size": 24}


# ---- the search: one measurement where the script's own loader is the limit ---------------------------------------


def slow_own_loader(**changes):
    """CPU ranks whose model alone runs 300 imgs/s, where the script's own loader (PIL) feeds 100 and the
    project's libjpeg-turbo pipeline 900 (inputs of the tests)."""
    return cpu_ranks(supplies={"pil": 100.0, "torchvision-cpu": 900.0}, **changes)


def test_where_its_own_loader_bounds_the_job_the_projects_pipeline_is_measured_once_on_its_folder(tmp_path, two_cores):
    sim = Sim(tmp_path, slow_own_loader(), 8, image_folder=FOLDER)
    (part,) = [v for v in sim.views if v.stage == view.Stage.IMAGE_LOADER]
    assert part.outcome == "part" and part.part, (part.failure_class, part.failure_message)
    # The built-in job in loader mode on the script's folder and crop, decoding with the fastest this machine has
    # (on CPU ranks, libjpeg-turbo in the workers), at the batch and workers of the script's own supply.
    (ran,) = [r["config"] for r in sim.pool.runs if r["config"].data.kind == "imagefolder"]
    (own,) = [r["config"] for r in sim.pool.runs if r["config"].training.mode == "loader" and r is not ran
              and r["config"].data.kind == "script"]
    assert (ran.training.mode, ran.data.path, ran.data.image_size, ran.data.decode) == \
        ("loader", FOLDER["path"], 176, "torchvision-cpu")
    assert not ran.script.given and ran.problems() == []
    assert (ran.training.batch_size, ran.loader.num_workers) == (own.training.batch_size, own.loader.num_workers)
    # A figure beside the script's own, never a pipeline its trials run.
    assert all(v.setting("data.decode") == "pil" for v in sim.views if v.end_to_end)
    assert view.Stage.IMAGE_LOADER not in {v.stage for v in sim.views if v.end_to_end}


def test_the_stages_keep_a_scripts_own_loader_workers_alive_between_epochs(tmp_path, two_cores):
    # Spawned anew every epoch otherwise: on 1xH200 the first end-to-end trial of a script's own loader (16 PIL
    # workers, a 62-step epoch, not persistent) ran at 67 % of the loader alone, restarts inside both.
    sim = Sim(tmp_path, slow_own_loader(), 8)
    own = [r["config"] for r in sim.pool.runs if r["config"].data.kind == "script"]
    supply = [c for c in own if c.training.mode == "loader"]
    (candidate,) = [v for v in sim.views if v.stage == "candidate"]
    assert supply and all(c.loader.persistent_workers and c.loader.num_workers > 0 for c in supply)
    assert candidate.setting("loader.persistent_workers") is True


def test_show_the_report_and_the_closing_lines_say_both_figures_and_the_change(tmp_path, two_cores, monkeypatch,
                                                                                capsys):
    sim = Sim(tmp_path, slow_own_loader(), 8, image_folder=FOLDER)
    line = overview.image_loader_line(sim.views)
    assert line is not None, sim.lines
    found = re.search(r"the script's own loader feeds ([\d.,]+) imgs/s \(trial p\d+\); "
                      r'run\.image_loader\("/data/photos/train", image_size=176\) would feed ([\d,]+) '
                      r"\(torchvision-cpu, trial p\d+\) on the same files: build its loader with that instead of "
                      r"run\.loader\(dataset, \.\.\.\) \(docs/scripts\.md: the fix, not only the limit\)", line)
    assert found, line
    # Each figure a measurement of the simulated pace (100 and 900 imgs/s) to the supplies' precision.
    own, would = (float(g.replace(",", "")) for g in found.groups())
    assert own == pytest.approx(100, rel=0.03) and would == pytest.approx(900, rel=0.03), line
    shown = overview.table(sim.study)
    assert f"the change to make: {line}" in shown and shown.count("would feed") == 1
    assert f"would feed {found.group(2)}" in first_screen(sim.study)
    # The search's closing lines: after the fastest trial, the change (``autotune search`` prints both).
    import autotune.search
    from autotune.cli import main

    monkeypatch.setattr(autotune.search, "search", lambda options, say=print: sim.study)
    main(["search", "--script", str(REPO / "examples" / "folder_ddp.py"), "--trials", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("autotune: fastest: ") and out[-1] == f"autotune: {line}", out[-3:]


@pytest.mark.parametrize("case", ["own-loader-keeps-up", "not-an-image-folder"])
def test_nothing_is_measured_or_said_where_the_own_loader_keeps_up_or_reads_no_image_folder(tmp_path, two_cores,
                                                                                             case):
    if case == "own-loader-keeps-up":  # 3,000 imgs/s of PIL against a model that takes 300
        sim = Sim(tmp_path, cpu_ranks(supplies={"pil": 3000.0, "torchvision-cpu": 9000.0}), 8, image_folder=FOLDER)
    else:
        sim = Sim(tmp_path, slow_own_loader(), 8)
    assert view.Stage.IMAGE_LOADER not in {v.stage for v in sim.views}
    assert overview.image_loader_line(sim.views) is None and "would feed" not in overview.table(sim.study)


# ---- for real: the measurement's config runs, on the example script's live worker ---------------------------------


@pytest.mark.timeout(600)
def test_the_measurement_runs_on_the_live_worker_of_the_example_script(tiny_jpegs, tmp_path, two_cores,
                                                                        repo_on_pythonpath):
    """``examples/folder_ddp.py:main`` on the tiny JPEGs (as its trial 0 runs: its settings record names its folder),
    then the project's pipeline alone on that folder (the stage's config), then the script's loader alone: one worker
    for all three."""
    from autotune.runner.pool import WorkerPool
    from autotune.runner.trial import TrialJob
    from autotune.search.script import script_spec
    from autotune.search.stages._folder import fastest_decode

    spec = script_spec(f"{REPO / 'examples' / 'folder_ddp.py'}:main", ["--data", str(tiny_jpegs), "--image-size",
                                                                        "32"], gpu=False)
    base = spec.base_config().with_overrides({
        "training.mode": "measure", "training.batch_size": 4, "loader.num_workers": 1,
        "script.applies": ["batch_size", "num_workers"], "measure.warmup_min_steps": 2, "measure.window_s": 0.2,
        "measure.precision": 0.05, "measure.max_s": 0.8, "measure.warmup_max_s": 30, "ddp.timeout_s": 60.0})

    def job(cfg, name):
        return TrialJob(config=cfg.with_overrides({"output_dir": str(tmp_path / name)}), trial_dir=tmp_path / name,
                        nproc_per_node=2, timeout_s=120.0)

    with WorkerPool(tmp_path / "workers") as pool:
        own = pool.run(job(base, "own"))
        (settings,) = own.of_kind("settings")
        folder = settings["image_folder"]
        assert folder == {"path": str(tiny_jpegs.resolve()), "image_size": 32,
                          "classes": len(datasets.ImageFolder(str(tiny_jpegs)).classes)}
        theirs = pool.run(job(base.with_overrides({
            "training.mode": "loader", "data.decode": fastest_decode(on_gpu=False), "data.kind": "imagefolder",
            "data.path": folder["path"],
            "data.image_size": folder["image_size"], "script.path": None, "script.entry": None, "script.args": [],
            "script.applies": []}), "theirs"))
        again = pool.run(job(base.with_overrides({"training.mode": "loader"}), "again"))
        assert all(r.summary and r.summary["imgs_per_s"] > 0 for r in (own, theirs, again)), \
            [r.log_path.read_text()[-2000:] for r in (own, theirs, again) if not r.summary]
        assert theirs.summary["mode"] == again.summary["mode"] == "loader", (theirs.summary, again.summary)
        assert pool.launched == 1, [r.worker for r in (own, theirs, again)]
