"""The knob table is the one place a knob is declared: every entry must name a real setting with valid values, and a
knob added to a table (here a test's own) reaches the space, the labels, the OOM signature, the export and a user's
script through the runtime without another module changing."""

from __future__ import annotations

import socket

import optuna
import pytest
import yaml

from autotune.policy import POLICIES, Policy, policy
from trainer import knobs
from trainer.config import TrainConfig, scope_of
from trainer.knobs import AUTO, GpuChoice, Knob, Range, knob, label_of, table

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.parametrize("path", sorted(knobs.SHIPPED.knobs))
def test_every_knob_is_a_setting_with_valid_choices(path):
    k = knob(path)
    section, leaf = path.split(".")
    assert leaf in TrainConfig().to_dict()[section], f"{path}: no such TrainConfig setting"
    r = k.space or Range()
    # A conditional knob is drawn only where its condition holds: its values are checked there.
    where = {}
    if r.when and " == " in r.when:
        cond, _, value = r.when.partition(" == ")
        where = {cond: yaml.safe_load(value)}
    # The values its facts and the search's policy name (GPU-only choices, measuring orders, first values) are values
    # too, if not all built-in choices.
    p = policy(path)
    for value in [*(r.choices or ()), *(end for end in (r.low, r.high) if end not in (None, AUTO)), *k.gpu_values,
                  *p.gpu_order, *p.cpu_order, *(v for v in (p.first, p.off) if v is not knobs.UNSET),
                  *((p.full_run[0],) if p.full_run else ())]:
        TrainConfig().with_overrides({**where, path: value})  # raises ConfigError for a value the job refuses
    assert scope_of(path) == k.scope
    assert (p.one_off_s is None) == (p.one_off_attr is None)


def test_the_search_has_one_policy_entry_for_each_knob_of_the_table():
    assert list(POLICIES) == list(knobs.SHIPPED.knobs)
    # A knob the search has no entry for (a test's own, a setting a spec names) takes the default policy: in the
    # built-in space where the table in use has it.
    assert policy("optimizer.momentum") == Policy(path="optimizer.momentum", default_space=False)
    with knobs.extended(MOMENTUM):
        assert policy("optimizer.momentum") == Policy(path="optimizer.momentum")


def test_runtime_names_are_unique_and_cover_every_non_nccl_knob():
    t = table()
    assert len(t.by_runtime_name) == len([k for k in t.entries if k.runtime])
    assert {k.path for k in t.entries if k.runtime is None} == {p for p in t.knobs if p.startswith("nccl.")}
    assert all(k.runtime for k in t.entries if k.applied_by)


def test_memory_settings_include_the_model_and_the_memory_knobs():
    settings = table().memory_settings
    assert {"model.name", "data.image_size", "training.precision"} <= set(settings)
    assert "ddp.bucket_cap_mb" not in settings


def test_a_table_lists_a_path_once():
    with pytest.raises(ValueError, match=r"training\.batch_size listed twice"):
        knobs.Table((*knobs.SHIPPED.entries, knob("training.batch_size")))


def test_a_config_failure_that_names_a_knob_is_repaired_as_its_entry_says():
    from autotune.search.repair import repair_for
    from trainer.config import ConfigError
    from trainer.protocol import Failure

    with pytest.raises(ConfigError) as refused:
        TrainConfig().with_overrides({"ddp.static_graph": True, "training.accum_steps": 2})
    repair = repair_for(Failure.CONFIG, str(refused.value), None, batches=[64])
    assert repair.changes == {"ddp.static_graph": False} and "accumulation" in repair.why
    message = "optimizer.momentum=0.99: refused"
    assert repair_for(Failure.CONFIG, message, None, batches=[64]) is None
    with knobs.extended(Knob(path="optimizer.momentum", label="mom", scope="model", repair=(0.9, "a test's"))):
        assert repair_for(Failure.CONFIG, message, None, batches=[64]).changes == {"optimizer.momentum": 0.9}


# ---- a test's own knob --------------------------------------------------------------------------------------------

MOMENTUM = Knob(path="optimizer.momentum", label="mom", scope="model", space=Range(choices=(0.9, 0.95, 0.99)),
                gpu_only=(GpuChoice(value=0.99, why="a test's GPU-only choice"),), memory=True, runtime="momentum",
                runtime_default=0.9, doc="SGD's momentum, as a test's knob")
"""Part of the built-in space, memory-relevant, received by a script as ``momentum``: a setting the built-in job
already applies (``optimizer.momentum``), so the table entry is all a knob needs."""

SPEC = {"name": "mom", "base": {"data": {"kind": "script"}, "script": {"path": "train.py",
                                                                      "applies": ["batch_size", "momentum"]}},
        "space": {"training.batch_size": [8, 16]}, "baseline": {"optimizer.momentum": 0.9}}


def searched(spec):
    """A study of two recorded trials: trial 0 (the baseline, momentum 0.9) and a faster one at momentum 0.95."""
    from autotune.objective import Objective
    from autotune.search.evaluate import Evaluation
    from autotune.search.record import record
    from autotune.space import resolve
    from autotune.study.setup import create_or_load

    space = resolve(spec, world_size=1, nproc_per_node=1, cpu_only=True, cores=2, applies={"batch_size", "momentum"})
    objective = Objective(kind="throughput")
    study = create_or_load(spec=spec, study_name=spec.name, storage=optuna.storages.InMemoryStorage(),
                           objective=objective, nproc=1, attrs={"torchrun_args": []})
    base = spec.base_config()
    for i, (params, ips) in enumerate((({"training.batch_size": 8, "optimizer.momentum": 0.9}, 100.0),
                                       ({"training.batch_size": 16, "optimizer.momentum": 0.95}, 150.0))):
        study.enqueue_trial(params)
        trial = study.ask()
        overrides = space.suggest(trial, base.to_dict())
        ev = Evaluation(stage="baseline" if i == 0 else "search", config=base.with_overrides(overrides),
                        imgs_per_s=ips, ci_half_width=0.01, figures={"env": {}, "versions": {}})
        record(study, trial, ev, objective, space)
    return space, study


def test_a_knob_added_to_a_test_table_reaches_the_space_labels_oom_signature_export_and_runtime(tmp_path,
                                                                                                monkeypatch):
    from autotune import export, overview
    from autotune.ranges import default_space
    from autotune.space import memory_signature, predicted_oom
    from autotune.spec import StudySpec
    from trainer import runtime

    plain = TrainConfig().to_dict()
    assert label_of("optimizer.momentum") == "momentum" and "optimizer.momentum" not in default_space()
    with knobs.extended(MOMENTUM):
        spec = StudySpec.from_dict(SPEC)  # its base's script applies `momentum`, its baseline names the knob
        space, study = searched(spec)
        # The space: the table's range, less its GPU-only choice on CPU ranks, for a script that applies it.
        p = space.by_path()["optimizer.momentum"]
        assert p.knob is MOMENTUM and p.choices == (0.9, 0.95)
        assert "optimizer.momentum: 0.99 dropped (no GPU: a test's GPU-only choice)" in space.notes
        assert set(space.by_path()) == {"training.batch_size", "optimizer.momentum"}  # what the script applies
        # The labels `autotune show` prints.
        assert "bs=16 mom=0.95" in overview.table(study)
        # The OOM signature: an OOM at one momentum says nothing about a larger batch at another.
        at = {m: TrainConfig().with_overrides({"optimizer.momentum": m}).to_dict() for m in (0.9, 0.95)}
        assert memory_signature(at[0.9]) != memory_signature(at[0.95])
        assert predicted_oom(at[0.95], [(3, at[0.9])]) is None and predicted_oom(at[0.9], [(3, at[0.9])]) == 3
        # The export: the chosen trial's momentum, in a file the job (and the script's runtime) reads back.
        data, _ = export.build(study, export.pick_trial(study))
        assert data["optimizer"]["momentum"] == 0.95 and data["autotune"]["params"]["optimizer.momentum"] == 0.95
        best = export.write(data, tmp_path / "best.yaml")
        assert TrainConfig.from_yaml(best).script.applies == ["batch_size", "momentum"]
        # The runtime: a script run with the exported file receives the knob by its runtime name.
        monkeypatch.setenv("AUTOTUNE_CONFIG", str(best))
        run = _script_run(monkeypatch, momentum=0.5)
        try:
            assert run.momentum == 0.95 and run.settings() == {"momentum": 0.95}
        finally:
            run.close()
    # Outside the block the shipped table is back: nothing of the test's knob is left.
    assert label_of("optimizer.momentum") == "momentum" and memory_signature(at[0.9]) == memory_signature(at[0.95])
    assert memory_signature(plain) == memory_signature(at[0.9])
    with pytest.raises(TypeError, match="unknown setting 'momentum'"):
        runtime.setup(momentum=0.5)


def _script_run(monkeypatch, **defaults):
    """``runtime.setup(**defaults)`` as a plain ``python train.py`` would make it (a world of one on gloo), with the
    environment it sets restored after the test."""
    from trainer import runtime
    from trainer.protocol import SAFETY_ENV

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {**SAFETY_ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    return runtime.setup(**defaults)
