"""Input-pipeline plumbing that needs no job: samplers and file lists."""

import itertools

from torch.utils.data import DistributedSampler

from tests.jobutil import make_jpeg_folder, tiny_config
from trainer.data.files import list_samples, resolve_splits
from trainer.data.sampling import StreamingSampler, train_sampler


def test_streaming_sampler_is_consecutive_epochs_without_a_stop():
    data = list(range(11))
    for rank in (0, 1):
        ref = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7, drop_last=True)
        expected = []
        for epoch in range(2, 6):
            ref.set_epoch(epoch)
            expected += list(ref)
        stream = StreamingSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7, drop_last=True)
        stream.set_epoch(2)
        assert list(itertools.islice(stream, len(expected))) == expected
        assert len(stream) == len(ref) == 5  # len() is still one epoch


def test_only_train_runs_have_epochs():
    data = list(range(8))
    assert type(train_sampler(data, tiny_config(), rank=0, world_size=2)) is StreamingSampler
    train = tiny_config(**{"training.mode": "train", "training.epochs": 1})
    assert type(train_sampler(data, train, rank=0, world_size=2)) is DistributedSampler


def test_val_fraction_holds_out_each_class_disjointly(tmp_path):
    root = make_jpeg_folder(tmp_path, classes=3, per_class=8)
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(root), "data.val_fraction": 0.25})
    train, val = resolve_splits(cfg)
    all_samples, classes = list_samples(root)
    assert sorted(train.samples + val.samples) == sorted(all_samples)
    assert not set(train.samples) & set(val.samples)
    assert sorted(label for _, label in val.samples) == [0, 0, 1, 1, 2, 2]
    assert train.classes == val.classes == classes
