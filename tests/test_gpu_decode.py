"""The nvjpeg-gpu and hybrid pipelines' device-agnostic parts, on CPU: byte packing, torchvision-exact crop sampling
and resampling, the one-batch-ahead pipeline (decoding with libjpeg-turbo on a CPU device), the hybrid CPU/GPU split,
and the hybrid path through the real 2-rank gloo job. Of nvjpeg-hw (hardware engines, GPU only), what a CPU machine
can check: its config errors and its validation split."""

from __future__ import annotations

import io
import multiprocessing
import sys
import threading

import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import find_classes, make_dataset
from torchvision.io import decode_jpeg, read_file
from torchvision.transforms.v2 import functional as F

from tests.jobutil import kinds, run_job, tiny_config
from trainer.config import ConfigError, TrainConfig
from trainer.data import (
    DeviceNormalize,
    LoaderPipeline,
    TensorJPEGDataset,
    build_pipeline,
    cpu_transforms,
)
from trainer.datagen import make_image_folder
from trainer.gpu_decode import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchedDecodePipeline,
    GpuDecodePipeline,
    HybridCollate,
    HybridDataset,
    HybridDecodePipeline,
    JpegBytesDataset,
    antialias_weights,
    batched_resized_crop,
    collate_bytes,
    cpu_share,
    decode_batch,
    import_nvimgcodec,
    make_hw_decoder,
    pack_bytes,
    sample_crop_boxes,
    unpack_bytes,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    make_image_folder(root, images=72, classes=4, workers=2, progress=False)
    return root / "train"


def samples_of(root):
    _, class_to_idx = find_classes(str(root))
    return make_dataset(str(root), class_to_idx, extensions=(".jpg",))


@pytest.fixture(scope="module")
def decoded(folder):
    return [decode_jpeg(read_file(path)) for path, _ in samples_of(folder)[:24]]


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.sort(a).values, torch.sort(b).values
    points = torch.cat([a, b])
    fa = torch.searchsorted(a, points, right=True) / len(a)
    fb = torch.searchsorted(b, points, right=True) / len(b)
    return float((fa - fb).abs().max())


# ---- crop + resize ---------------------------------------------------------------------------------------------------


def reference(images, boxes, size, flip, *, dtype):
    out = []
    for img, (top, left, h, w), f in zip(images, boxes.tolist(), flip.tolist()):
        r = F.resized_crop(img.to(dtype) if dtype != torch.uint8 else img, top, left, h, w, [size, size],
                           antialias=True)
        out.append(r.flip(-1) if f else r)
    return torch.stack(out).float()


def test_batched_crop_matches_torchvision_per_image(decoded):
    g = torch.Generator().manual_seed(0)
    heights = torch.tensor([im.shape[1] for im in decoded])
    widths = torch.tensor([im.shape[2] for im in decoded])
    boxes = sample_crop_boxes(heights, widths, generator=g)
    # The extremes too: the whole image, a 9x13 crop blown up 20x, and a crop already at the output size.
    boxes[0] = torch.tensor([0, 0, heights[0], widths[0]])
    boxes[1] = torch.tensor([5, 7, 9, 13])
    boxes[2] = torch.tensor([3, 4, 224, 224])
    flip = torch.rand(len(decoded), generator=g) < 0.5

    out = batched_resized_crop(decoded, boxes, 224, flip=flip, normalize=False)
    assert out.shape == (len(decoded), 3, 224, 224) and out.dtype == torch.float32
    # Same maths as interpolate(antialias=True) on float input; measured: mean 6e-6, max 4.4e-4 (0-255 scale).
    err = (out - reference(decoded, boxes, 224, flip, dtype=torch.float32)).abs()
    assert err.mean() < 1e-4 and err.max() < 5e-3, (err.mean(), err.max())
    # torchvision's uint8 kernel rounds with fixed-point weights; rounding ours lands within 1 (measured: mean 0.17).
    err8 = (out.round().clamp(0, 255) - reference(decoded, boxes, 224, flip, dtype=torch.uint8)).abs()
    assert err8.max() <= 1 and err8.mean() < 0.3, (err8.mean(), err8.max())

    # float16 matmuls (the CUDA default): measured mean 0.04, max 0.26 — below the uint8 path's own rounding.
    half = batched_resized_crop(decoded[:4], boxes[:4], 224, flip=flip[:4], normalize=False,
                                compute_dtype=torch.float16)
    err16 = (half - out[:4]).abs()
    assert err16.mean() < 0.1 and err16.max() < 1.0, (err16.mean(), err16.max())


def test_antialias_taps_hold_every_weight_of_the_dense_filter():
    # The dense definition (every input column, same float32 arithmetic), against the taps-only computation, from
    # 224x up to 16x down.
    lengths = torch.tensor([1, 9, 13, 224, 225, 300, 448, 451, 1999, 3584])
    size, max_len = 224, 3584
    flip = torch.arange(len(lengths)) % 2 == 1
    length = lengths.float().view(-1, 1, 1)
    scale = length / size
    support = scale.clamp(min=1.0)
    centre = scale * (torch.arange(size, dtype=torch.float32).view(1, -1, 1) + 0.5)
    j = torch.arange(max_len, dtype=torch.float32).view(1, 1, -1)
    dense = (1 - ((j + 0.5 - centre) / support).abs()).clamp(min=0) * (j < length)
    dense = dense / dense.sum(2, keepdim=True)
    dense = torch.where(flip.view(-1, 1, 1), dense.flip(1), dense)
    ours = antialias_weights(lengths, size, max_len, flip=flip)
    assert ours.shape == (len(lengths), size, max_len)
    torch.testing.assert_close(ours, dense, atol=1e-6, rtol=0)  # only the order of the sums differs
    assert bool(((ours > 0).sum(2) == (dense > 0).sum(2)).all())  # no tap lost at any scale


def test_grouping_by_crop_size_changes_nothing(decoded):
    # One big photo among small ones: grouped by crop size, each group padded to its own largest crop.
    big = torch.nn.functional.interpolate(decoded[0][None].float(), size=(900, 1300), mode="bilinear")[0]
    images = [big.round().to(torch.uint8)] + decoded[1:12]
    heights = torch.tensor([im.shape[1] for im in images])
    widths = torch.tensor([im.shape[2] for im in images])
    boxes = sample_crop_boxes(heights, widths, generator=torch.Generator().manual_seed(2))
    boxes[0] = torch.tensor([10, 20, 850, 1200])
    flip = torch.arange(12) % 3 == 0
    whole = batched_resized_crop(images, boxes, 32, flip=flip, channels_last=True, max_cells=2**40)
    grouped = batched_resized_crop(images, boxes, 32, flip=flip, channels_last=True, max_cells=120_000)
    assert grouped.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(grouped, whole, atol=1e-4, rtol=1e-4)
    ref = reference(images, boxes, 32, flip, dtype=torch.float32)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(grouped, (ref / 255 - mean) / std, atol=1e-4, rtol=1e-4)


def test_normalize_and_channels_last(decoded):
    boxes = sample_crop_boxes(torch.tensor([im.shape[1] for im in decoded[:6]]),
                              torch.tensor([im.shape[2] for im in decoded[:6]]), generator=torch.Generator())
    raw = batched_resized_crop(decoded[:6], boxes, 64, normalize=False)
    norm = batched_resized_crop(decoded[:6], boxes, 64, channels_last=True)
    assert norm.is_contiguous(memory_format=torch.channels_last)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(norm, (raw / 255 - mean) / std, atol=1e-5, rtol=1e-5)


# ---- crop sampling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("height, width", [(375, 500), (500, 333), (300, 300), (60, 400)])
def test_crop_boxes_follow_torchvision_distribution(height, width):
    n, scale, ratio = 4000, (0.08, 1.0), (3 / 4, 4 / 3)
    torch.manual_seed(0)
    ref = torch.tensor([T.RandomResizedCrop.get_params(torch.empty(1, height, width), scale, ratio)
                        for _ in range(n)], dtype=torch.float64)
    ours = sample_crop_boxes(torch.full((n,), height), torch.full((n,), width), scale=scale, ratio=ratio,
                             generator=torch.Generator().manual_seed(1))
    assert ours.dtype == torch.int64 and ours.shape == (n, 4)
    top, left, h, w = ours.double().unbind(1)
    assert bool(((top >= 0) & (left >= 0) & (h >= 1) & (w >= 1)).all())
    assert bool(((top + h <= height) & (left + w <= width)).all())

    def features(b):
        top, left, h, w = b.double().unbind(1)
        return {"area": h * w / (height * width), "log_ratio": torch.log(w / h),
                "top": top / (height - h + 1), "left": left / (width - w + 1)}

    # Two-sample Kolmogorov-Smirnov at alpha = 0.001: critical value 1.949 * sqrt(2 / n) = 0.044 for n = 4000.
    fr, fo = features(ref), features(ours)
    for key in fr:
        assert ks_statistic(fr[key], fo[key]) < 0.044, key
    # 60x400 (aspect 6.7) fails many tries: the centre-crop fallback must be as frequent as torchvision's.
    if (height, width) == (60, 400):
        def fallback_rate(b):
            top, left, h, w = b.unbind(1)
            return float(((h == 60) & (w == 80) & (top == 0) & (left == 160)).double().mean())

        assert fallback_rate(ref) > 0.2
        assert abs(fallback_rate(ref) - fallback_rate(ours.double())) < 0.03


def test_inside_the_ranges_and_the_fallback_rule():
    heights = torch.tensor([375, 500, 300, 60, 480])
    widths = torch.tensor([500, 333, 300, 400, 64])
    g = torch.Generator().manual_seed(3)
    boxes = sample_crop_boxes(heights.repeat(400), widths.repeat(400), scale=(0.2, 0.5), ratio=(0.5, 2.0),
                              generator=g)
    h, w = boxes[:, 2].double(), boxes[:, 3].double()
    area = h * w / (heights.repeat(400) * widths.repeat(400))
    tried = area < 0.55  # boxes that are not the fallback; rounding moves the area a little
    assert tried.float().mean() > 0.9
    assert bool(((area[tried] > 0.18) & (area[tried] < 0.52)).all())
    assert bool(((w / h)[tried] > 0.5 * 0.9).all() and ((w / h)[tried] < 2.0 * 1.1).all())

    # No try can fit (the aspect ratios asked for are far beyond any image's): the centred crop, exactly torchvision's.
    for extreme in ((1000.0, 2000.0), (0.0005, 0.001)):
        ours = sample_crop_boxes(heights, widths, ratio=extreme, generator=g)
        for k in range(len(heights)):
            ref = T.RandomResizedCrop.get_params(torch.empty(1, int(heights[k]), int(widths[k])), (0.08, 1.0),
                                                 extreme)
            assert tuple(ours[k].tolist()) == tuple(ref), (extreme, k)


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


def test_decode_batch_gray_cmyk_and_png_as_rgb():
    rgb = Image.new("RGB", (40, 30), (200, 30, 10))
    blobs = []
    for mode, fmt in (("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "JPEG"), ("RGB", "PNG")):
        b = io.BytesIO()
        rgb.convert(mode).save(b, fmt)
        blobs.append(torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8))
    out = decode_batch(blobs, "cpu")
    assert [tuple(t.shape) for t in out] == [(3, 30, 40)] * 4
    assert all(t.dtype == torch.uint8 for t in out)
    assert (out[2][:, 15, 20].int() - torch.tensor([200, 30, 10])).abs().max() < 8  # colours survive


# ---- the pipeline ----------------------------------------------------------------------------------------------------


def config(**overrides) -> TrainConfig:
    # Train mode: these tests iterate whole epochs (measure runs stream epochs without end).
    base = {"data.kind": "imagefolder", "data.path": "unused", "data.image_size": 48, "training.batch_size": 8,
            "loader.num_workers": 2, "training.channels_last": True, "training.seed": 5,
            "training.mode": "train", "training.epochs": 1}
    return TrainConfig().with_overrides({**base, **overrides})


def test_gpu_pipeline_refuses_a_cpu_device(folder):
    with pytest.raises(ConfigError) as e:
        GpuDecodePipeline(config(), samples_of(folder), rank=0, world_size=1, device="cpu")
    assert e.value.problems == ["data.decode=nvjpeg-gpu needs a CUDA GPU: use torchvision-cpu or pil on this machine"]


HW_INSTALL = "pip install 'ddp-autotune[nvjpeg-hw]'"


@pytest.fixture
def no_nvimgcodec(monkeypatch):
    # A None entry makes the import fail as if the package were not installed, whatever this machine has.
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)


def test_nvimgcodec_missing_is_one_line_naming_the_extra(no_nvimgcodec):
    with pytest.raises(ConfigError) as e:
        import_nvimgcodec()
    missing = f"data.decode=nvjpeg-hw needs NVIDIA nvImageCodec, which is not installed: {HW_INSTALL}"
    assert e.value.problems == [missing]
    with pytest.raises(ConfigError, match=r"ddp-autotune\[nvjpeg-hw\]"):
        make_hw_decoder("cuda")


def test_hw_pipeline_refuses_a_cpu_device_and_names_every_fix(folder, no_nvimgcodec):
    # The same CUDA check as nvjpeg-gpu, plus the missing package, reported together before any worker starts.
    with pytest.raises(ConfigError) as e:
        GpuDecodePipeline(config(**{"data.decode": "nvjpeg-hw"}), samples_of(folder), rank=0, world_size=1,
                          device="cpu")
    assert e.value.problems == [
        "data.decode=nvjpeg-hw needs a CUDA GPU: use torchvision-cpu or pil on this machine",
        f"data.decode=nvjpeg-hw needs NVIDIA nvImageCodec, which is not installed: {HW_INSTALL}"]
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("decode", ["nvjpeg-gpu", "nvjpeg-hw"])
def test_gpu_decode_paths_train_on_the_gpu_and_validate_with_torchvision_cpu(folder, decode):
    cfg = config(**{"data.decode": decode, "data.path": str(folder), "data.val_fraction": 0.25,
                    "loader.num_workers": 0})
    with pytest.raises(ConfigError, match=f"data.decode={decode} needs a CUDA GPU"):
        build_pipeline(cfg, rank=0, world_size=1, device=torch.device("cpu"))
    val = build_pipeline(cfg, rank=0, world_size=1, device=torch.device("cpu"), split="val")
    assert isinstance(val, LoaderPipeline) and isinstance(val.loader.dataset, TensorJPEGDataset)
    images, labels = next(iter(val))
    assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32 and labels.dtype == torch.int64
    val.close()


def test_pipeline_epochs_labels_and_determinism(folder):
    samples = samples_of(folder)
    pipe = BatchedDecodePipeline(config(), samples, rank=1, world_size=2, device="cpu")
    assert len(pipe) == (72 // 2) // 8 == 4
    pipe.set_epoch(3)
    first = list(pipe)
    assert len(first) == 4
    for images, labels in first:
        assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last) and labels.dtype == torch.int64
        assert torch.isfinite(images).all() and -3 < images.mean() < 3
    # Rank 1's share of DistributedSampler(seed, epoch 3), in batches: the labels say the order is the sampler's.
    order = list(pipe.sampler)
    assert torch.cat([lb for _, lb in first]).tolist() == [samples[i][1] for i in order[:32]]
    again = list(pipe)  # same epoch: the same files, crops and flips
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    pipe.set_epoch(4)
    other = list(pipe)
    assert not torch.equal(first[0][0], other[0][0])
    assert multiprocessing.active_children() == []  # each finished epoch shut its workers down
    pipe.close()


def test_pipeline_stops_cleanly_when_the_consumer_leaves_early(folder):
    pipe = BatchedDecodePipeline(config(**{"loader.persistent_workers": True}), samples_of(folder), rank=0,
                                 world_size=1, device="cpu")
    batches = iter(pipe)
    next(batches)  # the consumer holds the generator and walks away mid-epoch
    assert len(multiprocessing.active_children()) == 2
    assert any(t.name == "gpu-decode" for t in threading.enumerate())
    again = next(iter(pipe))  # a new epoch's iterator stops the abandoned one first
    assert again[0].shape == (8, 3, 48, 48)
    pipe.close()
    assert not any(t.name == "gpu-decode" for t in threading.enumerate())
    assert multiprocessing.active_children() == []


def test_pipeline_reraises_a_loader_error(folder, tmp_path):
    samples = [(str(tmp_path / "missing.jpg"), 0)] * 16
    pipe = BatchedDecodePipeline(config(), samples, rank=0, world_size=1, device="cpu")
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        for _ in pipe:
            pass
    pipe.close()
    assert multiprocessing.active_children() == []
    with pytest.raises(ConfigError, match="cannot fill one batch"):
        BatchedDecodePipeline(config(), samples[:7], rank=0, world_size=1, device="cpu")


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
    for p, (item, (path, label)) in enumerate(zip(items, [samples[i] for i in indices])):
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


def test_hybrid_batch_is_the_cpu_share_then_the_gpu_share(folder):
    samples = samples_of(folder)
    cfg = config(**{"data.decode": "hybrid", "data.hybrid_cpu_fraction": 0.25, "loader.num_workers": 0})
    pipe = HybridDecodePipeline(cfg, samples, rank=1, world_size=2, device="cpu")
    pipe.set_epoch(2)
    torch.manual_seed(5)  # no workers: the CPU share draws from this process's RNG
    images, labels = next(iter(pipe))
    pipe.close()
    batch = list(pipe.sampler)[:8]
    assert images.shape == (8, 3, 48, 48) and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.tolist() == [samples[i][1] for i in batch]

    torch.manual_seed(5)
    transform = cpu_transforms(cfg, train=True, decode="torchvision-cpu")
    cpu_part = torch.stack([TensorJPEGDataset(samples, transform)[i][0] for i in batch[:2]])
    normalize = DeviceNormalize(torch.device("cpu"), channels_last=True)
    torch.testing.assert_close(images[:2], normalize(cpu_part), atol=1e-5, rtol=1e-5)
    buf, lengths, _ = collate_bytes([JpegBytesDataset(samples)[i] for i in batch[2:]])
    generator = torch.Generator().manual_seed((cfg.training.seed * 100_003 + 2) * 4_099 + 1)
    torch.testing.assert_close(images[2:], pipe.decode_and_crop(buf, lengths, generator), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_hybrid_extremes_and_determinism(folder, fraction):
    pipe = HybridDecodePipeline(config(**{"data.decode": "hybrid", "data.hybrid_cpu_fraction": fraction}),
                                samples_of(folder), rank=0, world_size=2, device="cpu")
    pipe.set_epoch(1)
    first = list(pipe)
    assert len(first) == 4 and all(x.shape == (8, 3, 48, 48) and torch.isfinite(x).all() for x, _ in first)
    again = list(pipe)  # workers reseeded from (seed, epoch, rank): the same crops
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    pipe.set_epoch(2)
    assert not torch.equal(first[0][0], next(iter(pipe))[0])
    pipe.close()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_hybrid_runs_in_the_real_job(tiny_jpegs, tmp_path):
    cfg = tiny_config(**{"data.kind": "imagefolder", "data.path": str(tiny_jpegs), "data.decode": "hybrid",
                         "data.hybrid_cpu_fraction": 0.5})
    code, records, log = run_job(cfg, tmp_path)
    assert code == 0, log
    windows, (summary,) = kinds(records, "window"), kinds(records, "summary")
    assert len(windows) >= 3 and all(w["images"] == w["steps"] * 4 * 2 for w in windows)
    assert summary["loss_finite"] and summary["imgs_per_s"] > 0
