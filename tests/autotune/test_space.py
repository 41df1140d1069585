"""Search space → real Optuna trials: conditional knobs, derived accumulation, baseline, known-OOM skipping."""

from __future__ import annotations

import optuna
import pytest

from autotune.exceptions import SpecError
from autotune.policy import policy
from autotune.ranges import default_space
from autotune.space import predicted_oom, resolve
from autotune.spec import StudySpec
from trainer.config import TrainConfig
from trainer.knobs import table

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _spec(**over):
    data = {"name": "t", "base": {"model": {"name": "resnet18"}}}
    data.update(over)
    return StudySpec.from_dict(data)


DALI_KNOBS = {k.path for k in table().entries if k.space is not None and k.space.when == "data.decode == dali"
              and policy(k.path).default_space}


@pytest.fixture
def dali(monkeypatch):
    """Whether NVIDIA DALI is installed, as the space sees it: set by the test, whatever this machine has."""
    def installed(yes: bool):
        monkeypatch.setattr("autotune.space.importable", lambda module: yes if module == "nvidia.dali" else True)
    installed(False)
    return installed


def test_default_space_has_the_architecture_knobs_and_resolves_auto_per_rank(dali):
    spec = _spec()
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False, cores=32)
    p = space.by_path()
    assert set(p) == set(default_space()) - DALI_KNOBS  # DALI is not installed: its settings say nothing
    assert (p["loader.num_workers"].low, p["loader.num_workers"].high) == (0, 16)  # cores per rank
    assert p["data.decode"].choices == ("pil", "torchvision-cpu", "nvjpeg-gpu", "hybrid")
    assert not any(k.startswith("nccl.") for k in p)  # NCCL's debugging variables: a spec adds them
    # torch.compile on a GPU machine (the stages weigh its compile); not its modes (minutes per graph)
    assert p["training.compile"].choices == (False, True) and "training.compile_mode" not in p
    order = [x.path for x in space.params]
    assert order.index("loader.num_workers") < order.index("loader.prefetch_factor")


def test_dali_is_searched_only_on_a_gpu_with_the_package_and_the_space_says_why_not(dali):
    gpu = resolve(_spec(), world_size=1, nproc_per_node=1, cpu_only=False, cores=8)
    assert "dali" not in gpu.by_path()["data.decode"].choices and not DALI_KNOBS & set(gpu.by_path())
    assert "data.decode: dali dropped (nvidia.dali is not installed: pip install 'ddp-autotune[dali]')" in gpu.notes
    assert any(n.startswith("data.dali_threads: not searched") for n in gpu.notes)
    # Without DALI in the space, the loader's knobs are suggested as before, in their own place.
    assert gpu.by_path()["loader.num_workers"].when is None
    dali(True)
    cpu = resolve(_spec(), world_size=1, nproc_per_node=1, cpu_only=True, cores=8)
    assert "dali" not in cpu.by_path()["data.decode"].choices
    assert "data.decode: dali dropped (no GPU: DALI decodes on the mixed device)" in cpu.notes
    gpu = resolve(_spec(), world_size=1, nproc_per_node=1, cpu_only=False, cores=8)
    p = gpu.by_path()
    assert "dali" in p["data.decode"].choices and DALI_KNOBS.issubset(p)
    assert (p["data.dali_threads"].low, p["data.dali_threads"].high) == (1, 8)


def test_under_dali_the_loader_knobs_are_not_suggested_and_its_own_are(dali):
    dali(True)
    spec = _spec()
    space = resolve(spec, world_size=1, nproc_per_node=1, cpu_only=False, cores=8)
    base = spec.base_config().to_dict()
    loader = {"loader.num_workers", "loader.prefetch_factor", "loader.persistent_workers", "loader.pin_memory"}
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        o = space.suggest(trial, base)
        seen.add(o["data.decode"])
        if o["data.decode"] == "dali":
            assert not loader & set(o) and DALI_KNOBS.issubset(o)
        else:
            assert not DALI_KNOBS & set(o) and "loader.num_workers" in o
        study.tell(trial, 1.0)
    assert "dali" in seen and len(seen) > 1
    # The decode is suggested before the knobs whose condition reads it.
    order = [p.path for p in space.params]
    assert order.index("data.decode") < order.index("loader.num_workers") < order.index("loader.prefetch_factor")
    under = spec.base_config().to_dict()
    under["data"]["decode"] = "dali"
    assert not loader & set(space.baseline_params(spec, under))


def test_cpu_only_drops_what_needs_a_gpu():
    space = resolve(_spec(), world_size=2, nproc_per_node=2, cpu_only=True, cores=2)
    p = space.by_path()
    assert "nvjpeg-gpu" not in p["data.decode"].choices and "fp16" not in p["training.precision"].choices
    assert not any(k.startswith("nccl.") for k in p)
    assert p["loader.num_workers"].high == 1
    assert any("nvjpeg-gpu dropped" in n for n in space.notes)
    # Inductor's C++ compile takes minutes on CPU ranks: compile only where a spec names it.
    assert "training.compile" not in p
    named = resolve(_spec(space={"training.compile": [False, True]}), world_size=2, nproc_per_node=2,
                    cpu_only=True, cores=2)
    assert named.by_path()["training.compile"].choices == (False, True)


def test_conditional_knobs_only_appear_when_their_condition_holds():
    spec = _spec(default_space=False, space={
        "loader.num_workers": {"low": 0, "high": 2},
        "loader.prefetch_factor": {"low": 1, "high": 8, "when": "loader.num_workers > 0"},
        "loader.persistent_workers": {"choices": [False, True], "when": "loader.num_workers > 0"},
        "nccl.algo": {"choices": ["default", "Ring"], "when": "data.decode in [nvjpeg-gpu]"},  # reads the base
    })
    space = resolve(spec, world_size=1, nproc_per_node=1, cpu_only=False, cores=4)
    base = spec.base_config().to_dict()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    seen_zero = seen_more = False
    for _ in range(30):
        t = study.ask()
        over = space.suggest(t, base)
        TrainConfig().with_overrides(over)  # every suggestion is a valid config
        if over["loader.num_workers"] == 0:
            seen_zero = True
            assert "loader.prefetch_factor" not in t.params and "loader.persistent_workers" not in t.params
        else:
            seen_more = True
            assert 1 <= over["loader.prefetch_factor"] <= 8
        assert "nccl.algo" not in over  # base decode is pil
        study.tell(t, 1.0)
    assert seen_zero and seen_more


def test_fixed_global_batch_derives_accumulation_and_drops_batches_that_do_not_divide():
    spec = _spec(default_space=False, fixed_global_batch=256,
                 space={"training.batch_size": [16, 32, 48, 64, 256], "training.precision": ["fp32", "bf16"]})
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False, cores=8)
    assert space.by_path()["training.batch_size"].choices == (16, 32, 64)  # 48 and 256 cannot make 256 over 2 ranks
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(10):
        t = study.ask()
        over = space.suggest(t, spec.base_config().to_dict())
        assert over["training.batch_size"] * over["training.accum_steps"] * 2 == 256
        assert "training.accum_steps" not in t.params  # derived, not searched
        study.tell(t, 1.0)
    with pytest.raises(SpecError, match="no batch choice divides it"):
        resolve(_spec(default_space=False, fixed_global_batch=100, space={"training.batch_size": [64]}),
                world_size=2, nproc_per_node=2, cpu_only=False, cores=8)


def test_baseline_becomes_trial_0_params_through_enqueue():
    spec = _spec(baseline={"training.batch_size": 64, "loader.num_workers": 4, "loader.prefetch_factor": 2,
                           "nccl.algo": "default"}, space={"nccl.algo": ["default", "Ring", "Tree"]})
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False, cores=32)
    base = spec.base_config().to_dict()
    params = space.baseline_params(spec, base)
    assert params["training.batch_size"] == 64 and params["nccl.algo"] is None  # "default": NCCL's own choice
    assert params["training.precision"] == "fp32"  # not in the baseline: the base value
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial(params)
    t = study.ask()
    over = space.suggest(t, base)
    assert {k: over[k] for k in params} == params
    bad = _spec(baseline={"training.batch_size": 80})
    with pytest.raises(SpecError, match=r"baseline.training.batch_size=80: outside the searched \{32, 48"):
        resolve(bad, world_size=1, nproc_per_node=1, cpu_only=False, cores=4).baseline_params(
            bad, bad.base_config().to_dict())


def test_an_oom_rules_out_larger_batches_with_the_same_memory_settings_only():
    def cfg(**o):
        return TrainConfig().with_overrides(o).to_dict()

    ooms = [(7, cfg(**{"training.batch_size": 128, "training.precision": "fp32"}))]
    assert predicted_oom(cfg(**{"training.batch_size": 256, "training.precision": "fp32"}), ooms) == 7
    assert predicted_oom(cfg(**{"training.batch_size": 128, "loader.num_workers": 9}), ooms) == 7
    assert predicted_oom(cfg(**{"training.batch_size": 96}), ooms) is None
    assert predicted_oom(cfg(**{"training.batch_size": 256, "training.precision": "bf16"}), ooms) is None
    assert predicted_oom(cfg(**{"training.batch_size": 256, "training.channels_last": True}), ooms) is None


def test_default_space_never_suggests_a_config_the_job_refuses():
    # static_graph is only drawn without accumulation (DDP's reducer asserts under no_sync with it).
    spec = _spec()
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False, cores=32)
    base = spec.base_config("/data").to_dict()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(60):
        over = space.suggest(study.ask(), base)
        TrainConfig.from_dict(base).with_overrides(over)
        seen.add((over["training.accum_steps"], over.get("ddp.static_graph")))
    assert (1, True) in seen and not any(acc > 1 and sg is not None for acc, sg in seen)


def test_starts_become_partial_fixed_params_and_gpu_only_starts_are_left_out_on_a_cpu():
    starts = [{"data.decode": "nvjpeg-gpu", "training.precision": "fp16"},
              {"data.decode": "torchvision-cpu", "training.batch_size": 256, "nccl.algo": "default"}]
    spec = _spec(starts=starts, space={"nccl.algo": ["default", "Ring", "Tree"]})
    gpu = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False, cores=32)
    assert gpu.start_params(spec) == [starts[0], {**starts[1], "nccl.algo": None}]
    cpu = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2)
    assert cpu.start_params(spec) == [{"data.decode": "torchvision-cpu", "training.batch_size": 256}]
    assert any(n.startswith("start 0 left out: data.decode=nvjpeg-gpu") for n in cpu.notes), cpu.notes
    # A start's params are fixed on its trial; what it leaves out is drawn.
    base = spec.base_config("/data").to_dict()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial(gpu.start_params(spec)[0])
    over = gpu.suggest(study.ask(), base)
    assert over["data.decode"] == "nvjpeg-gpu" and over["training.precision"] == "fp16" and "loader.num_workers" in over
    with pytest.raises(SpecError, match=r"starts\[0\].training.batch_size=80: outside the searched"):
        bad = _spec(starts=[{"training.batch_size": 80}])
        resolve(bad, world_size=1, nproc_per_node=1, cpu_only=False, cores=4).start_params(bad)
    with pytest.raises(SpecError, match=r"starts\[0\].optimizer.lr: not a searched knob"):
        _spec(starts=[{"optimizer.lr": 0.1}])


def test_a_base_value_outside_the_space_is_moved_in_with_a_note_but_a_written_baseline_is_not():
    """A minimal spec (a name and a model) gets a baseline from the base config: torch's 4 loader workers on a
    machine that allows 1 per rank become 1, said in a note, instead of an error about a value nobody wrote."""
    spec = _spec(base={"model": {"name": "resnet18"}, "data": {"kind": "imagefolder", "path": "/d"},
                       "loader": {"num_workers": 4}})
    space = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2)
    params = space.baseline_params(spec, spec.base_config().to_dict())
    assert params["loader.num_workers"] == 1
    assert any(n.startswith("baseline: loader.num_workers=1 (the base's 4 is not searched on this machine")
               for n in space.notes)
    # A value the spec's own baseline names inside the spec's range, beyond this machine's cores (its auto end):
    # moved in too, with a note; outside the range the spec declares: an error naming the fix.
    written = _spec(base=spec.base, baseline={"loader.num_workers": 4})
    moved = resolve(written, world_size=2, nproc_per_node=2, cpu_only=True, cores=2)
    assert moved.baseline_params(written, written.base_config().to_dict())["loader.num_workers"] == 1
    assert any("the spec's baseline 4 is not searched on this machine" in n for n in moved.notes)
    fixed = _spec(base=spec.base, baseline={"loader.num_workers": 4},
                  space={"loader.num_workers": {"low": 0, "high": 2}})
    with pytest.raises(SpecError, match=r"baseline.loader.num_workers=4: outside the searched \[0 .. 2\]"):
        resolve(fixed, world_size=2, nproc_per_node=2, cpu_only=True, cores=2).baseline_params(
            fixed, fixed.base_config().to_dict())


def test_the_space_fits_the_data_and_synthetic_data_has_no_pipeline_knobs():
    spec = _spec()
    small = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2, max_batch=100)
    assert max(small.by_path()["training.batch_size"].choices) == 96
    assert any("128, 192, 256, 384, 512 dropped (the data holds 100 training images per rank" in n
               for n in small.notes)
    synthetic = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2, synthetic=True)
    assert not any(p.path.startswith(("data.", "loader.")) for p in synthetic.params)
    assert "training.batch_size" in synthetic.by_path()


def test_a_scripts_own_dali_pipeline_has_its_settings_searched_without_the_projects_decode():
    # The script reads run.dali_threads and run.dali_prefetch for a pipeline of its own: no data.decode of ours.
    space = resolve(_spec(), world_size=1, nproc_per_node=1, cpu_only=False, cores=8,
                    applies={"batch_size", "dali_threads", "dali_prefetch", "dali_hw_decoder_load"})
    p = space.by_path()
    applied = {"data.dali_threads", "data.dali_prefetch", "data.dali_hw_decoder_load"}
    assert applied <= set(p) and not DALI_KNOBS - applied & set(p)  # what it does not read is not searched
    assert "data.decode" not in p and all(p[k].when is None for k in applied)
