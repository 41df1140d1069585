"""TrainConfig: YAML round trip, overrides, and one clear message per bad field (all reported at once)."""

import pytest
import yaml

from tests.helpers.cli import REPO
from trainer.config import ConfigError, TrainConfig, scope_of


def test_defaults_round_trip_through_yaml(tmp_path):
    cfg = TrainConfig().with_overrides({"training.precision": "bf16", "nccl.algo": "Ring", "data.crop_scale": [0.2, 1]})
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    again = TrainConfig.from_yaml(path)
    assert again == cfg
    assert again.data.crop_scale == (0.2, 1.0)
    assert again.nccl.to_env() == {"NCCL_ALGO": "allreduce:Ring"}


def test_export_section_is_ignored_by_the_job(tmp_path):
    data = TrainConfig().to_dict()
    data["autotune"] = {"torchrun": ["--nproc-per-node", "2"], "measured": {"imgs_per_s": 1.0}}
    assert TrainConfig.from_dict(data) == TrainConfig()


def test_a_config_with_retired_measurement_settings_still_loads():
    data = TrainConfig().to_dict()
    data["measure"].update(settle_steps=5, settle_span_s=1.0, settle_tolerance=0.1)  # what older exports wrote
    with pytest.warns(FutureWarning, match="measure.settle_steps, measure.settle_span_s, measure.settle_tolerance"):
        assert TrainConfig.from_dict(data) == TrainConfig()
    del data["measure"]["settle_steps"], data["measure"]["settle_span_s"], data["measure"]["settle_tolerance"]
    data["measure"].update(windows=3, max_windows=8, spread_target=0.05)  # window agreement, replaced by intervals
    with pytest.warns(FutureWarning, match=r"measure.windows, measure.max_windows, measure.spread_target: retired "
                                           r"\(a measurement ends on its interval"):
        assert TrainConfig.from_dict(data) == TrainConfig()
    data["measure"]["settle_everything"] = 1  # anything else unknown is still an error
    with pytest.raises(ConfigError, match=r"measure\.settle_everything: unknown setting"):
        TrainConfig.from_dict(data)


@pytest.mark.parametrize("overrides, message", [
    ({"loader.num_workers": 0, "loader.prefetch_factor": 4}, "prefetch_factor is set but loader.num_workers is 0"),
    ({"loader.num_workers": 0, "loader.persistent_workers": True}, "persistent_workers needs"),
    ({"training.batch_size": 0}, "training.batch_size=0: must be >= 1"),
    ({"training.accum_steps": 0}, "training.accum_steps=0"),
    ({"training.precision": "fp8"}, "expected one of fp32, bf16, fp16"),
    ({"training.batch_size": "big"}, "expected an integer"),
    ({"training.channels_last": "yes"}, "expected true or false"),
    ({"data.kind": "imagefolder"}, "data.path is required"),
    ({"data.decode": "bogus"}, "expected one of pil, torchvision-cpu, nvjpeg-gpu"),
    ({"data.dali_hw_decoder_load": 1.5}, "data.dali_hw_decoder_load=1.5: must be in [0, 1]"),
    ({"data.dali_prefetch": 0}, "data.dali_prefetch=0: must be >= 1"),
    ({"data.crop_scale": [0.5, 0.1]}, "needs 0 < low <= high"),
    ({"training.mode": "train"}, "needs training.epochs or training.steps"),
    ({"optimizer.lr": 0.0}, "optimizer.lr=0.0: must be > 0"),
    ({"measure.precision": 0.0}, "measure.precision=0.0: must be between 0 and 1"),
    ({"measure.max_s": 0.1}, "measure.max_s=0.1: must be at least measure.window_s"),
    ({"nccl.extra": {"NCCL_NVLS_ENABLE": "1"}}, "NVLink multicast must stay off"),
    ({"nccl.extra": {"NCCL_PROTO": "LL128"}}, "LL128 may not be forced"),
    ({"nccl.extra": {"OMP_NUM_THREADS": "4"}}, "only NCCL_* variables"),
    # Found by the first real GPU search: DDP's reducer asserts on the first backward inside no_sync().
    ({"ddp.static_graph": True, "training.accum_steps": 2}, "static graph breaks under gradient accumulation"),
])
def test_each_bad_field_gets_its_message(overrides, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig().with_overrides(overrides)
    assert any(message in p for p in e.value.problems), e.value.problems


def test_an_unknown_decode_path_lists_the_pipelines():
    with pytest.raises(ConfigError, match=r"expected one of pil, torchvision-cpu, nvjpeg-gpu, hybrid, dali$"):
        TrainConfig().with_overrides({"data.decode": "bogus"})


USE_DALI = "for the GPU's hardware JPEG decoder use data.decode: dali (pip install 'ddp-autotune[dali]')"


def test_a_config_asking_for_the_removed_nvjpeg_hw_pipeline_gets_one_line_each_naming_dali(tmp_path):
    data = TrainConfig().to_dict()
    data["data"].update(decode="nvjpeg-hw", hybrid_hw_fraction=0.25, hw_roi_decode=True)
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    assert e.value.problems == [
        f"data.hybrid_hw_fraction=0.25: removed with data.decode=nvjpeg-hw; {USE_DALI}",
        f"data.hw_roi_decode=True: removed with data.decode=nvjpeg-hw; {USE_DALI}",
        f"data.decode=nvjpeg-hw: removed; {USE_DALI}"]
    with pytest.raises(ConfigError) as e:  # the same through overrides (the tuner's and `python -m trainer --set`)
        TrainConfig().with_overrides({"data.decode": "nvjpeg-hw"})
    assert e.value.problems == [f"data.decode=nvjpeg-hw: removed; {USE_DALI}"]
    with pytest.raises(ConfigError, match=r"^data\.hybrid_hw_fraction=0\.5: removed with"):
        TrainConfig().with_overrides({"data.hybrid_hw_fraction": 0.5})
    # A config built in code (a script's run.image_loader(decode=...)) is checked by problems().
    from trainer.config import DataConfig

    assert DataConfig(decode="nvjpeg-hw").problems() == [f"data.decode=nvjpeg-hw: removed; {USE_DALI}"]
    assert DataConfig(decode="jpeg").problems() == [
        "data.decode='jpeg': expected one of pil, torchvision-cpu, nvjpeg-gpu, hybrid, dali"]


def test_an_export_from_before_nvjpeg_hw_was_removed_still_loads():
    # Every exported config and stored trial wrote the removed fields, at the values that left the engines unused.
    data = TrainConfig().with_overrides({"data.decode": "hybrid"}).to_dict()
    data["data"].update(hybrid_hw_fraction=0.0, hw_roi_decode=False)
    assert TrainConfig.from_dict(data) == TrainConfig().with_overrides({"data.decode": "hybrid"})


def test_a_spec_naming_nvjpeg_hw_or_its_settings_gets_the_fix():
    from autotune.exceptions import SpecError
    from autotune.spec import StudySpec

    with pytest.raises(SpecError) as e:
        StudySpec.from_dict({"name": "t", "base": {"data": {"decode": "nvjpeg-hw"}}, "space": {
            "data.decode": ["nvjpeg-gpu", "nvjpeg-hw"], "data.hybrid_hw_fraction": [0.0, 0.25],
            "data.hw_roi_decode": [False, True]}})
    assert e.value.problems == [
        f"base.data.decode=nvjpeg-hw: removed; {USE_DALI}",
        f"space.data.decode: choice 'nvjpeg-hw': data.decode=nvjpeg-hw: removed; {USE_DALI}",
        f"space.data.hybrid_hw_fraction: removed with data.decode=nvjpeg-hw; {USE_DALI}",
        f"space.data.hw_roi_decode: removed with data.decode=nvjpeg-hw; {USE_DALI}"]


def test_the_cpu_only_space_drops_nvjpeg_gpu():
    from autotune.space import resolve
    from autotune.spec import StudySpec

    spec = StudySpec.from_dict({"name": "t", "base": {"model": {"name": "resnet18"}}, "default_space": False,
                                "space": {"data.decode": {"choices": ["torchvision-cpu", "nvjpeg-gpu"]}}})
    cpu = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2).by_path()["data.decode"]
    gpu = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=False, cores=32).by_path()["data.decode"]
    assert cpu.choices == ("torchvision-cpu",)
    assert gpu.choices == ("torchvision-cpu", "nvjpeg-gpu")
    notes = resolve(spec, world_size=2, nproc_per_node=2, cpu_only=True, cores=2).notes
    assert "data.decode: nvjpeg-gpu dropped (no GPU)" in notes


def test_all_problems_are_reported_at_once():
    data = {"training": {"batch_size": 0, "precison": "bf16"}, "loader": {"num_workers": 0, "prefetch_factor": 2},
            "modle": {}}
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    text = " | ".join(e.value.problems)
    assert "training.precison: unknown setting (did you mean precision?)" in text
    assert "modle: unknown setting (did you mean model?)" in text
    # Type errors are reported first; once types are right, the cross-field checks report everything together.
    data = {"training": {"batch_size": 0}, "loader": {"num_workers": 0, "prefetch_factor": 2}}
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    assert len(e.value.problems) == 2


def test_unknown_override_path_is_named():
    with pytest.raises(ConfigError, match=r"training\.batch: no such setting"):
        TrainConfig().with_overrides({"training.batch": 3})


def test_bad_yaml_is_one_clear_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("training: {batch_size: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.from_yaml(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        TrainConfig.from_yaml(p)
    with pytest.raises(ConfigError, match="no such file"):
        TrainConfig.from_yaml(tmp_path / "missing.yaml")


def test_yaml_is_plain(tmp_path):
    # Tuples must serialize as plain lists: the YAML is for humans and other tools, not only for PyYAML.
    text = TrainConfig().to_yaml()
    assert "!!python" not in text
    assert yaml.safe_load(text)["data"]["crop_ratio"] == [0.75, 4 / 3]


def test_every_shipped_job_config_is_valid():

    configs = sorted((REPO / "bench" / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = TrainConfig.from_yaml(path)
        assert TrainConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg, path


def test_every_problem_of_a_config_is_listed_at_once():
    """A badly typed value must not hide the other problems: the cross-field checks run on the rest."""
    data = TrainConfig().to_dict()
    data["training"].update(batch_size=-1, precision="fp64")
    data["optimizer"]["lr"] = -1
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    assert len(e.value.problems) == 3, e.value.problems
    assert e.value.problems[0].startswith("training.precision='fp64': expected one of fp32, bf16, fp16")
    assert "training.batch_size=-1: must be >= 1" in e.value.problems
    assert "optimizer.lr=-1.0: must be > 0" in e.value.problems


def test_a_type_error_does_not_add_a_problem_about_its_default():
    data = TrainConfig().to_dict()
    data["training"]["batch_size"] = "big"  # left at its default (64) while building: nothing else to say about it
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    assert e.value.problems == ["training.batch_size='big': expected an integer"]


@pytest.mark.parametrize("path, scope", [("nccl.algo", "process"), ("ddp.timeout_s", "process"),
                                         ("ddp.bucket_cap_mb", "model"), ("training.precision", "model"),
                                         ("loader.num_workers", "pipeline"), ("data.decode", "pipeline")])
def test_each_setting_says_what_changing_it_takes(path, scope):
    assert scope_of(path) == scope
