"""The sequence of trial configurations a seeded search launches, against a committed record of it.

The shipped studies (cpu-demo on CPU ranks, resnet50 on GPUs) are searched by the search's own engine, stage planner,
evaluator, pruner and recording step on a simulated machine (``tests.helpers.machine``: the figures are inputs, not
measurements), so every decision is deterministic: the same code launches the same configurations in the same order.
A refactor that claims to change no behaviour keeps this record; a change of behaviour rewrites it on purpose
(``AUTOTUNE_REWRITE_GOLDEN=1``), and the diff of the record is the change a reviewer reads.

Two records are of resnet50 on a budget of 240 s, spent on a clock of simulated seconds (``TIMED``): on a machine
that never compiled its graph, and on one whose compile caches hold it (a search with time to spare ran first).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import optuna
import pytest
import yaml

from autotune.search.engine import Engine
from autotune.search.progress import Progress
from autotune.study.setup import create_or_load
from tests.helpers.machine import FakePool, Machine, SimClock, constructed_plan, flat

optuna.logging.set_verbosity(optuna.logging.WARNING)

GOLDEN = Path(__file__).with_name("golden")
STUDIES = Path(__file__).resolve().parents[3] / "studies"

VOLATILE = ("name", "output_dir", "training.compile_cache_dir", "data.path")
"""Settings that name where a trial runs, not what it runs."""

MACHINES = {
    "cpu-demo": (False, Machine(ceilings={("fp32", False): 120.0, ("fp32", True): 80.0, ("bf16", False): 60.0,
                                          ("bf16", True): 50.0},
                                supplies={"pil": 90.0, "torchvision-cpu": 150.0}, plateau=16, max_workers=1)),
    "resnet50": (True, Machine(ceilings={("fp16", True): 6300.0, ("fp16", False): 4200.0, ("bf16", True): 5600.0,
                                         ("bf16", False): 3800.0, ("fp32", True): 2500.0, ("fp32", False): 2100.0},
                               supplies={"pil": 2500.0, "torchvision-cpu": 6000.0, "nvjpeg-gpu": 11000.0},
                               plateau=256, max_workers=16, cudnn_gain=1.002, compile_gain=1.15, compile_s=40.0,
                               noisy={"pil": 0.1})),
}


TIMED = {  # name: (study, its machine, budget, caches warmed first). Seconds of the order 1xH200 showed for ResNet-50
    # (a cold compile 55 s, from the caches 6 s, a fresh worker 15 s), and trial 0 settling at once, as it did there.
    f"resnet50-240s-{state}": ("resnet50", dataclasses.replace(
        MACHINES["resnet50"][1], compile_s=55.0, cached_compile_s=6.0, run_s=6.0, fresh_s=15.0, noisy={}), 240.0,
        state == "cached") for state in ("cold", "cached")}


def launched(study: str, gpu: bool, machine: Machine, timeout_s: float | None = None,
             lines: list[str] | None = None) -> list[dict]:
    """Each run the pool was asked for, in order: the settings where it differs from the study's base config. With
    ``timeout_s``, on a clock of the runs' simulated seconds; the search's lines into ``lines``."""
    spec = yaml.safe_load((STUDIES / f"{study}.yaml").read_text())
    spec["base"]["data"]["path"] = "/sim"
    spec.pop("data", None)
    plan = constructed_plan(spec, gpu=gpu, trials=spec["budget"]["trials"], timeout_s=timeout_s,
                            trial_timeout_s=spec["budget"]["trial_timeout_s"])
    storage = optuna.storages.InMemoryStorage()
    study = create_or_load(spec=plan.spec, study_name=plan.name, storage=storage, objective=plan.objective, nproc=2,
                           baseline=plan.baseline, starts=plan.starts)
    clock, lines, out = SimClock(), lines if lines is not None else [], io.StringIO()
    with mock.patch("autotune.search.engine.time", SimpleNamespace(monotonic=clock.monotonic)):
        engine = Engine(plan, study, storage, lines.append)
        engine.progress = Progress(total=plan.trials, timeout_s=None, out=out)
        pool = FakePool(machine, "pool", clock=clock)
        engine.introduce()
        engine.run(pool)
    lines += out.getvalue().splitlines()
    base = flat(plan.base.to_dict())
    rows = []
    for r in pool.runs:
        cfg = flat(r["config"].to_dict())
        rows.append({k: v for k, v in sorted(cfg.items()) if k not in VOLATILE and base.get(k, object()) != v})
    return rows


@pytest.mark.parametrize("name", sorted(MACHINES) + sorted(TIMED))
def test_a_seeded_search_of_a_shipped_study_launches_the_recorded_sequence(name, in_tmp, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))  # the machine's compile caches and their records
    if name in MACHINES:
        rows = launched(name, *MACHINES[name])
    else:
        study, machine, budget, warm = TIMED[name]
        machine = dataclasses.replace(machine, on_disk=set())
        if warm:
            launched(study, True, machine)  # with time to spare: it compiles the graph into the machine's caches
        lines: list[str] = []
        rows = launched(study, True, machine, timeout_s=budget, lines=lines)
        said = "\n".join(lines)
        if warm:  # priced at what loading the graph costs: measured, and kept where it measured faster
            assert "stages: compiled measured: its first run costs about 8 s more (its graph is in this machine's " \
                   "compile caches" in said, said
            assert any(r.get("training.compile") for r in rows)
        else:
            assert "stages: compiled not measured: its first run costs about 60 s more (a prior: no compile of its " \
                   "graph is recorded on this machine)" in said, said
            assert not any(r.get("training.compile") for r in rows)
    path = GOLDEN / f"{name}.json"
    if os.environ.get("AUTOTUNE_REWRITE_GOLDEN"):
        path.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    want = json.loads(path.read_text())
    got = json.loads(json.dumps(rows, default=str))
    assert len(got) == len(want), f"{len(got)} runs launched, the record has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"run {i} differs from the record: {g} != {w}"
