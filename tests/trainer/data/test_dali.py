"""The dali pipeline: without NVIDIA DALI, one config error naming the extra before anything starts; with it (on DALI's
CPU operators: the mixed device needs a GPU), the Pipeline contract, disjoint shards reshuffled every epoch, the
endless stream of a measure run, the validation shard, an unreadable image named, and a close that leaves no thread
behind. The tests that need DALI skip without it (CI does not install it)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from autotune.space import importable
from tests.jobutil import kinds, run_job, tiny_config
from tests.trainer.data.common import config, samples_of
from trainer.config import ConfigError
from trainer.data import Pipeline, prefetched_batches
from trainer.data.dali import DaliPipeline, import_dali
from trainer.runtime._base import IMAGES

MISSING = "data.decode=dali needs NVIDIA DALI, which is not installed: pip install 'ddp-autotune[dali]'"

needs_dali = pytest.mark.skipif(not importable("nvidia.dali"), reason="NVIDIA DALI is not installed")


def dali_config(**overrides):
    return config(**{"data.decode": "dali", "data.dali_threads": 2, **overrides})


def test_dali_missing_is_one_config_error_naming_the_extra_and_starts_nothing(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed, whatever this machine has
    before = threading.active_count()
    with pytest.raises(ConfigError) as e:
        import_dali()
    assert e.value.problems == [MISSING]
    with pytest.raises(ConfigError) as e:
        DaliPipeline(dali_config(), samples_of(folder), train=True, rank=0, world_size=1, device="cpu")
    assert e.value.problems == [MISSING] and threading.active_count() == before


def test_the_decoder_takes_the_engines_share_and_where_the_rest_is_huffman_decoded():
    from trainer.data.dali import decoder_args

    assert decoder_args(dali_config(), on_gpu=False) == {"device": "cpu"}
    assert decoder_args(dali_config(**{"data.dali_hw_decoder_load": 0.35}), on_gpu=True) == {
        "device": "mixed", "hw_decoder_load": 0.35}  # DALI's own threshold: small images on its CPU threads
    assert decoder_args(dali_config(**{"data.dali_gpu_huffman": True}), on_gpu=True)["hybrid_huffman_threshold"] == 0


def test_a_script_receives_dalis_settings_and_its_queue_counts_as_prefetched():
    assert {"dali_hw_decoder_load", "dali_threads", "dali_prefetch", "dali_gpu_huffman"} <= set(IMAGES)
    # DALI has no loader workers: its queue is what is ready before the first step.
    assert prefetched_batches(dali_config(**{"loader.num_workers": 0, "data.dali_prefetch": 3})) == 3


@needs_dali
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the mixed device needs a GPU"))])
def test_the_pipeline_yields_the_contract_over_disjoint_reshuffled_shards(folder, device):
    samples = samples_of(folder)
    cfg = dali_config(**{"training.mode": "train"})
    before = {t.ident for t in threading.enumerate()}
    ranks = [DaliPipeline(cfg, samples, train=True, rank=r, world_size=2, device=device) for r in (0, 1)]
    again = DaliPipeline(cfg, samples, train=True, rank=0, world_size=2, device=device)
    try:
        assert isinstance(ranks[0], Pipeline)
        images, labels = next(iter(again))
        assert images.device.type == labels.device.type == device
        assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32 and labels.dtype == torch.int64
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert -3 < images.mean().item() < 3  # normalized, not 0..255
        for p in ranks:
            p._labels = torch.arange(len(p.samples), device=device)  # each batch as the files' indices
        epochs = []
        for epoch in (0, 1):
            seen = []
            for p in ranks:
                p.set_epoch(epoch)
                batches = list(p)
                assert len(batches) == len(p) == (len(samples) // 2) // 8  # the same steps on every rank
                seen.append(torch.cat([y for _, y in batches]).tolist())
            assert not set(seen[0]) & set(seen[1])  # disjoint shards
            assert seen[0] != sorted(seen[0])  # shuffled, from the first epoch on
            epochs.append(seen)
        assert set(epochs[0][0]) != set(epochs[1][0])  # reshuffled: another shard of the set in the next epoch
        # The same seed, the same order; each image's label is its file's class.
        assert labels.tolist() == [ranks[0].samples[i][1] for i in epochs[0][0][:8]]
    finally:
        for p in (*ranks, again):
            p.close()
    assert {t.ident for t in threading.enumerate()} <= before


def test_a_dali_crop_of_another_shape_is_one_problem_naming_the_shapes():
    with pytest.raises(ConfigError) as e:
        dali_config(**{"data.dali_crop": "centre"})
    assert e.value.problems == ["data.dali_crop='centre': expected one of roi, full"]
    assert {"dali_crop", "dali_half_out", "dali_antialias"} <= set(IMAGES)


@needs_dali
@pytest.mark.parametrize(("shape", "precision", "dtype"), [
    ({"data.dali_crop": "full"}, "fp32", torch.float32),
    ({"data.dali_half_out": True, "data.dali_antialias": False}, "bf16", torch.float16),
    ({"data.dali_half_out": True, "data.dali_crop": "full"}, "fp32", torch.float32),  # an fp32 model takes float32
])
def test_each_shape_of_the_graph_yields_the_contract_in_the_runs_dtype(folder, shape, precision, dtype):
    cfg = dali_config(**{"training.precision": precision, **shape})
    p = DaliPipeline(cfg, samples_of(folder), train=True, rank=0, world_size=1, device="cpu")
    try:
        images, labels = next(iter(p))
    finally:
        p.close()
    assert images.shape == (8, 3, 48, 48) and images.dtype == dtype and labels.dtype == torch.int64
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert -3 < images.float().mean().item() < 3 and images.float().std().item() > 0.1  # normalized crops


@needs_dali
def test_a_measure_run_reads_one_endless_stream_of_epochs(folder):
    p = DaliPipeline(dali_config(**{"training.mode": "measure"}), samples_of(folder), train=True, rank=0,
                     world_size=1, device="cpu")
    try:
        it = iter(p)
        assert len([next(it) for _ in range(3 * len(p) + 1)]) == 3 * len(p) + 1  # past three epochs, no stop
    finally:
        p.close()


@needs_dali
def test_validation_is_the_unaugmented_rank_shard_with_a_partial_last_batch(folder):
    samples = samples_of(folder)
    v = DaliPipeline(dali_config(**{"training.channels_last": False}), samples, train=False, rank=1, world_size=2,
                     device="cpu")
    try:
        batches = list(v)
        first = list(v)
    finally:
        v.close()
    shard = samples[len(samples) // 2:]
    assert sum(len(y) for _, y in batches) == len(shard) and len(batches) == len(v) == -(-len(shard) // 8)
    assert torch.cat([y for _, y in batches]).tolist() == [label for _, label in shard]
    assert torch.cat([y for _, y in first]).tolist() == [label for _, label in shard]  # the same shard each pass
    assert batches[0][0].is_contiguous() and batches[0][0].shape == (8, 3, 48, 48)
    assert torch.equal(batches[0][0], first[0][0])  # no augmentation: the same images each pass


@needs_dali
def test_an_unreadable_image_is_named(folder, tmp_path):
    samples = samples_of(folder)[:16]
    bad = tmp_path / "bad.jpg"
    bad.write_text("<html>403 Forbidden</html>")
    samples = [*samples[:3], (str(bad), 0), *samples[4:]]
    v = DaliPipeline(dali_config(), samples, train=False, rank=0, world_size=1, device="cpu")
    try:
        with pytest.raises(Exception, match=f"cannot decode {bad}"):
            list(v)
    finally:
        v.close()


@needs_dali
def test_the_job_trains_two_epochs_and_validates_through_dali_on_two_ranks(tiny_jpegs, tmp_path):
    # MLPerf's shape (the whole image decoded, then cropped) in float16 under bf16: the graph the search may pick
    # beside the default one the pipeline tests run.
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(tiny_jpegs), "data.decode": "dali",
                         "data.dali_threads": 1, "data.val_fraction": 0.25, "training.mode": "train",
                         "training.epochs": 2, "data.dali_crop": "full", "data.dali_half_out": True,
                         "training.precision": "bf16", "output_dir": str(tmp_path / "out")})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    (summary,) = kinds(records, "summary")
    assert summary["loss_finite"] and summary["epochs"] == 2
    # Each epoch validates every held-out image once over both ranks (3 classes x 3 of their 12 held out).
    assert [(r["epoch"], r["images"]) for r in kinds(records, "val")] == [(1, 9), (2, 9)]
