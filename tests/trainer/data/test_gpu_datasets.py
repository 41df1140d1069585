"""The GPU-decode paths' worker side, on CPU: file bytes packed into one tensor per batch, and the hybrid path's
split of every batch into a CPU-decoded share and a share of bytes."""

from __future__ import annotations

import pytest
import torch
from torchvision.datasets import ImageFolder

from tests.trainer.data.common import config, samples_of
from trainer.config import ConfigError, TrainConfig
from trainer.data.cpu import TensorJPEGDataset, cpu_transforms
from trainer.data.gpu.datasets import (
    HybridCollate,
    HybridDataset,
    JpegBytesDataset,
    collate_bytes,
    cpu_share,
    pack_bytes,
    unpack_bytes,
)

# ---- bytes -----------------------------------------------------------------------------------------------------------


def test_byte_dataset_is_the_image_folder(folder):
    ref = ImageFolder(str(folder))
    ds = JpegBytesDataset(samples_of(folder))
    assert len(ds) == len(ref.samples) == 72
    for i in range(len(ds)):
        data, label = ds[i]
        path, target = ref.samples[i]
        assert label == target == ref.targets[i]
        with open(path, "rb") as f:
            assert data == f.read()


def test_pack_unpack_round_trip(folder):
    blobs = [b"", b"\x00\xff" * 3, bytes(range(256)), b"x"]
    buf, lengths = pack_bytes(blobs)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and lengths.tolist() == [0, 6, 256, 1]
    assert [bytes(t.numpy()) for t in unpack_bytes(buf, lengths)] == blobs

    ds = JpegBytesDataset(samples_of(folder))
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2, collate_fn=collate_bytes)
    seen = 0
    for buf, lengths, labels in loader:
        assert buf.dtype == torch.uint8 and labels.dtype == torch.int64 and len(lengths) == len(labels)
        for k, view in enumerate(unpack_bytes(buf, lengths)):
            assert bytes(view.numpy()) == ds[seen + k][0] and int(labels[k]) == ds[seen + k][1]
        seen += len(labels)
    assert seen == len(ds)


# ---- hybrid ----------------------------------------------------------------------------------------------------------


def test_cpu_share_is_the_rounded_fraction_of_every_batch():
    assert [cpu_share(256, f) for f in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0, 64, 128, 192, 256]
    assert [cpu_share(8, f) for f in (0.1, 0.3, 0.5, 0.99)] == [1, 2, 4, 8]  # half up: 0.8 -> 1, 2.4 -> 2
    assert cpu_share(3, 0.5) == 2
    with pytest.raises(ConfigError, match=r"data.hybrid_cpu_fraction=1.5: must be in \[0, 1\]"):
        TrainConfig().with_overrides({"data.hybrid_cpu_fraction": 1.5})


def test_hybrid_worker_decodes_the_first_positions_like_torchvision_cpu(folder):
    samples = samples_of(folder)
    cfg = config(**{"data.hybrid_cpu_fraction": 0.3})
    transform = cpu_transforms(cfg, train=True, decode="torchvision-cpu")
    ds = HybridDataset(samples, transform, 0.3)
    indices = [17, 3, 40, 8, 71, 25, 0, 56]  # a sampler's batch: positions 0..1 decode here (0.3 x 8 -> 2)
    torch.manual_seed(11)
    items = ds.__getitems__(indices)
    torch.manual_seed(11)
    reference = TensorJPEGDataset(samples, transform)
    for p, (item, (path, label)) in enumerate(zip(items, [samples[i] for i in indices], strict=True)):
        assert item[1] == label
        if p < 2:
            image, expected_label = reference[indices[p]]
            assert item[0].dtype == torch.uint8 and item[0].shape == (3, 48, 48) and expected_label == label
            assert torch.equal(item[0], image)  # same RNG draws, same crop: the torchvision-cpu transform itself
        else:
            with open(path, "rb") as f:
                assert item[0] == f.read()
    images, buf, lengths, labels = HybridCollate(48)(items)
    assert images.shape == (2, 3, 48, 48) and images.dtype == torch.uint8
    assert torch.equal(images[1], items[1][0]) and len(lengths) == 6
    assert [bytes(v.numpy()) for v in unpack_bytes(buf, lengths)] == [x for x, _ in items[2:]]
    assert labels.tolist() == [samples[i][1] for i in indices]
    empty = HybridCollate(48)([(b"\xff", 1)])  # fraction 0: an empty CPU share still has the image shape
    assert empty[0].shape == (0, 3, 48, 48) and empty[3].tolist() == [1]
