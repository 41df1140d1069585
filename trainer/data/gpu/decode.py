"""Decode JPEG byte tensors to 3xHxW uint8 RGB on the device: nvJPEG's CUDA decoder through torchvision
(``decode_batch``: ``nvjpeg-gpu`` and ``hybrid``; libjpeg-turbo on a CPU device), or the GPU's hardware JPEG engines
through nvImageCodec (``decode_batch_hw``: ``nvjpeg-hw``).

``nvjpeg-hw`` changes only the decode: the GPU's fixed-function JPEG engines (NVJPG on A100/H100/H200) through
nvImageCodec instead of nvJPEG's CUDA kernels, which on 2xH200 took SMs from training (GPM SM activity 74 % with
nvjpeg-gpu vs 89 % on synthetic data; 9,300 vs 11,920 imgs/s). What the engines refuse goes to nvJPEG's CUDA
decoder, what that refuses to ``decode_batch``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from trainer.config import ConfigError
from trainer.data.gpu.crop import sample_crop_boxes

# ---- nvJPEG's CUDA decoder, through torchvision ----------------------------------------------------------------------


def decode_batch(blobs: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Decode JPEG byte tensors to 3xHxW uint8 RGB on ``device`` (nvJPEG batch decode on CUDA).

    Grayscale and CMYK JPEGs come out as RGB too. If the batch decode fails (a file nvJPEG cannot read, or a PNG
    named .jpg, as ImageNet has), that batch is decoded image by image, falling back to the CPU decoders."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    device = torch.device(device)
    try:
        return decode_jpeg(list(blobs), mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    out = []
    for blob in blobs:
        try:
            img = decode_jpeg(blob, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            img = decode_image(blob, mode=ImageReadMode.RGB).to(device)
        out.append(img)
    return out


# ---- the hardware JPEG engines, through nvImageCodec (nvjpeg-hw) -----------------------------------------------------

NVJPEG_HW_INSTALL = "pip install 'ddp-autotune[nvjpeg-hw]'"

HW_DECODE_CPU_THREADS = 4
"""Host threads of each rank's nvImageCodec decoder. The engines do the Huffman decoding; the host only parses
headers and feeds the few images the engines refuse to nvJPEG's CUDA decoder. nvImageCodec's default (one thread per
core, per rank) would compete with the loader workers for the cores."""


def import_nvimgcodec():
    """``nvidia.nvimgcodec``, or a ConfigError naming the extra that installs it (and libnvjpeg with it)."""
    try:
        return importlib.import_module("nvidia.nvimgcodec")
    except ModuleNotFoundError:
        problem = f"data.decode=nvjpeg-hw needs NVIDIA nvImageCodec, which is not installed: {NVJPEG_HW_INSTALL}"
    except (ImportError, OSError) as e:  # installed but broken (a missing shared library, another CUDA major)
        problem = f"data.decode=nvjpeg-hw: nvImageCodec does not load ({e}): reinstall it with {NVJPEG_HW_INSTALL}"
    raise ConfigError([problem]) from None


def make_hw_decoder(device: torch.device | str):
    """An nvImageCodec decoder on ``device`` that tries the hardware JPEG engines first and nvJPEG's CUDA decoder
    for what they refuse (progressive, CMYK or oddly subsampled JPEGs). Decoders allocate engine state and pinned
    buffers: make one per pipeline, in the thread that decodes (a pipeline's ``_decode`` does)."""
    nvimgcodec = import_nvimgcodec()
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(["data.decode=nvjpeg-hw needs a CUDA GPU: use torchvision-cpu or pil on this machine"])
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Only these backends may decode. nvImageCodec offers each image to its highest-priority decoder (the engines)
    # and passes what that refuses or fails on to the next one; a load_hint of 1 (the default) holds back nothing.
    backends = [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
                nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)]
    return nvimgcodec.Decoder(device_id=index, max_num_cpu_threads=HW_DECODE_CPU_THREADS, backends=backends)


def hw_decode_params(nvimgcodec=None):
    """RGB, interleaved (HWC: the engines' native output), uint8, and no EXIF rotation — the same pixel grid the
    other paths decode (torchvision's ``decode_jpeg`` ignores EXIF orientation too)."""
    nvimgcodec = nvimgcodec or import_nvimgcodec()
    return nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                   allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.I_RGB)


def decode_batch_hw(blobs: Sequence[torch.Tensor], device: torch.device | str, decoder,
                    params=None) -> list[torch.Tensor]:
    """Decode JPEG byte tensors (CPU) with an nvImageCodec ``decoder`` (``make_hw_decoder``) to 3xHxW uint8 RGB
    on ``device``, like ``decode_batch``; images nvImageCodec cannot decode go to ``decode_batch``.

    The decode runs on the current CUDA stream: nvImageCodec allocates each output there (stream-ordered) and its
    hardware decoder runs there; its CUDA decoder makes that stream wait for its own. So kernels queued next on the
    same stream see the pixels, and freeing an output (when its last tensor dies) is ordered after them. Each
    output is wrapped without a copy (``__cuda_array_interface__``; the tensor keeps the Image alive) and returned
    as a CHW *view* of the HWC buffer: ``batched_resized_crop`` flattens each image with ``reshape``, which makes
    that one copy into its batch buffer in CHW order."""
    device = torch.device(device)
    nvimgcodec = import_nvimgcodec()
    streams, positions, failed = [], [], []
    for i, blob in enumerate(blobs):
        try:  # wraps the bytes without a copy; the numpy view keeps the packed buffer alive while the stream lives
            streams.append(nvimgcodec.CodeStream(blob.numpy()))
            positions.append(i)
        except (RuntimeError, ValueError):  # unreadable bytes; 0.9 parses lazily and reports them as None below
            failed.append(i)
    return _decode_streams(blobs, streams, positions, failed, device, decoder, params, nvimgcodec)


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _decode_streams(blobs, streams, positions, failed, device, decoder, params, nvimgcodec) -> list[torch.Tensor]:
    """Decode nvImageCodec code streams (``positions[k]``: which blob ``streams[k]`` is); blobs in ``failed`` and
    images nvImageCodec returns as None go to ``decode_batch``, whole."""
    out: list[torch.Tensor | None] = [None] * len(blobs)
    failed = list(failed)
    if streams:
        decoded = decoder.decode(streams, params=params or hw_decode_params(nvimgcodec),
                                 cuda_stream=_current_stream(device))
        if len(decoded) != len(streams):  # nvImageCodec before 0.9 dropped failed images instead of returning None
            raise RuntimeError(f"nvImageCodec returned {len(decoded)} images for {len(streams)} files: "
                               f"install the tested version with {NVJPEG_HW_INSTALL}")
        for i, image in zip(positions, decoded, strict=True):
            if image is None:  # not a JPEG, or one neither the engines nor the CUDA decoder accept
                failed.append(i)
            else:
                out[i] = torch.as_tensor(image, device=device).permute(2, 0, 1)
    if failed and len(failed) == len(blobs) and len(blobs) >= 8:
        # A whole batch refused is not odd files but a decoder without codecs (libnvjpeg not found): failing
        # loudly beats quietly decoding every image through the fallback.
        raise RuntimeError(f"nvImageCodec decoded none of {len(blobs)} images (is libnvjpeg installed?): "
                           f"{NVJPEG_HW_INSTALL}")
    if failed:
        failed.sort()
        for i, image in zip(failed, decode_batch([blobs[i] for i in failed], device), strict=True):
            out[i] = image
    return out


def decode_crops_hw(blobs: Sequence[torch.Tensor], device: torch.device | str, decoder, *,
                    scale: tuple[float, float], ratio: tuple[float, float], generator: torch.Generator,
                    params=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decode only the RandomResizedCrop box of each JPEG (nvImageCodec's region decode; DALI's fused
    decode-and-crop): ``(images, boxes)`` with each image its box's pixels and each box ``[0, 0, h, w]`` of it.

    The boxes are drawn from the sizes in the files' headers, with the generator's draws in the order
    ``sample_crop_boxes`` makes them from decoded images, so the augmentation is the full decode's, pixel for pixel
    where the region decode is exact. A file whose header nvImageCodec cannot read is decoded whole first (its size
    is then known); one whose region no decoder takes is decoded whole afterwards, its box kept."""
    device = torch.device(device)
    nvimgcodec = import_nvimgcodec()
    streams: list = [None] * len(blobs)
    sizes: list[tuple[int, int] | None] = [None] * len(blobs)
    for i, blob in enumerate(blobs):
        try:
            cs = nvimgcodec.CodeStream(blob.numpy())
            if cs.height > 0 and cs.width > 0:
                streams[i], sizes[i] = cs, (cs.height, cs.width)
        except (RuntimeError, ValueError):
            pass
    whole = [i for i, size in enumerate(sizes) if size is None]
    decoded_whole = dict(zip(whole, decode_batch([blobs[i] for i in whole], device), strict=True)) if whole else {}
    for i, image in decoded_whole.items():
        sizes[i] = (image.shape[-2], image.shape[-1])
    boxes = sample_crop_boxes(torch.tensor([h for h, _ in sizes]), torch.tensor([w for _, w in sizes]), scale=scale,
                              ratio=ratio, generator=generator)
    regions, positions = [], []
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        if streams[i] is not None:
            regions.append(streams[i].get_sub_code_stream(region=nvimgcodec.Region(top, left, top + h, left + w)))
            positions.append(i)
    out: list[torch.Tensor | None] = [decoded_whole.get(i) for i in range(len(blobs))]
    refused = []
    if regions:
        decoded = decoder.decode(regions, params=params or hw_decode_params(nvimgcodec),
                                 cuda_stream=_current_stream(device))
        for i, image in zip(positions, decoded, strict=True):
            if image is None or tuple(image.shape[:2]) != tuple(boxes[i, 2:].tolist()):
                refused.append(i)
            else:
                out[i] = torch.as_tensor(image, device=device).permute(2, 0, 1)
                boxes[i, :2] = 0
    if refused:
        for i, image in zip(refused, decode_batch([blobs[i] for i in refused], device), strict=True):
            out[i] = image
    return out, boxes
