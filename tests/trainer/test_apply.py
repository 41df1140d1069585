"""The one place settings are applied (``trainer.apply``): the DataLoader's rule for settings that need workers or
CUDA, and the same DDP wrapper for the built-in job and a user's script given the same config — in-process, on a
process group of one (gloo)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.apply import data_loader, loader_args, loader_settings, script_distributed
from trainer.config import LoaderConfig, TrainConfig
from trainer.job import Job
from trainer.protocol import ResultWriter
from trainer.runtime._run import Run
from trainer.runtime.request import Request, activate

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
DATA = TensorDataset(torch.randn(8, 3, 4, 4), torch.zeros(8, dtype=torch.int64))


@pytest.mark.parametrize(("workers", "prefetch", "persistent", "pin"),
                         list(itertools.product((0, 2), (None, 4), (False, True), (False, True))))
def test_the_loader_rule_clears_what_needs_workers_and_pins_only_for_cuda(workers, prefetch, persistent, pin):
    loader = LoaderConfig(num_workers=workers, prefetch_factor=prefetch, persistent_workers=persistent,
                          pin_memory=pin)
    on_cpu, on_cuda = loader_args(loader, CPU), loader_args(loader, CUDA)
    expected = {"num_workers": workers, "prefetch_factor": prefetch if workers else None,
                "persistent_workers": persistent and workers > 0}
    assert on_cpu == {**expected, "pin_memory": False}
    assert on_cuda == {**expected, "pin_memory": pin}
    assert loader_settings(num_workers=workers, prefetch_factor=prefetch, persistent_workers=persistent,
                           pin_memory=pin).problems() == []  # a config the job accepts, too
    # DataLoader takes every combination so fitted; as given, it refuses a prefetch depth or persistent workers
    # without workers.
    built = data_loader(DATA, loader, CPU, batch_size=4)
    assert (built.num_workers, built.persistent_workers, built.pin_memory) == (workers, expected["persistent_workers"],
                                                                               False)
    if not workers and (prefetch or persistent):
        with pytest.raises(ValueError):
            DataLoader(DATA, batch_size=4, num_workers=0, prefetch_factor=prefetch, persistent_workers=persistent)


@pytest.fixture(scope="module")
def group():
    """A process group of one, started the way a script without torchrun gets one; the environment and the group
    are put back afterwards."""
    saved = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    try:
        env = script_distributed()
        yield env
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_a_script_gets_a_world_of_one_without_torchrun_and_keeps_a_group_that_exists(group):
    assert (group.rank, group.world_size, group.backend, group.device) == (0, 1, "gloo", CPU)
    again = script_distributed()  # the group exists now (as when a script started its own): joined, not restarted
    assert (again.rank, again.world_size, again.backend) == (0, 1, "gloo")


def _run(settings: dict, group) -> Run:
    return Run(Request(mode="plain", settings=settings), {}, unit="images", writer=ResultWriter(None, 0), env=group)


def test_a_scripts_loader_gets_the_same_rule(group):
    run = _run({"num_workers": 0}, group)
    try:
        # The script's own defaults (prefetch, persistent workers) cannot stand without workers: cleared, not refused.
        batches = run.loader(DATA, batch_size=4, prefetch_factor=4, persistent_workers=True, pin_memory=True)
        assert (batches.num_workers, batches.prefetch_factor, batches.persistent_workers, batches.pin_memory) == \
            (0, None, False, False)
    finally:
        run.close()
        activate(None)


def _wrapper(model: nn.Module) -> dict:
    conv = next(p for p in model.module.parameters() if p.ndim == 4)
    return {"bucket_bytes": model.bucket_bytes_cap, "gradient_as_bucket_view": model.gradient_as_bucket_view,
            "static_graph": model.static_graph, "find_unused_parameters": model.find_unused_parameters,
            "broadcast_buffers": model.broadcast_buffers, "device_ids": model.device_ids,
            "channels_last": conv.is_contiguous(memory_format=torch.channels_last)}


@pytest.mark.parametrize("ddp", [{"ddp.bucket_cap_mb": 7.0, "ddp.gradient_as_bucket_view": True,
                                  "ddp.static_graph": True, "training.channels_last": True}, {}])
def test_the_job_and_a_script_get_the_same_ddp_wrapper_for_the_same_config(group, ddp):
    cfg = TrainConfig().with_overrides({
        "model.name": "tests.helpers.models:tiny", "data.kind": "synthetic", "data.image_size": 8,
        "data.num_classes": 4, "training.batch_size": 2, "script.entry": "tests.helpers.scripts.seen:main",
        "script.applies": ["bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "channels_last"], **ddp})
    job = Job(cfg, group, ResultWriter(None, 0))
    try:
        job.build()
        from_job = _wrapper(job.model)
    finally:
        job.close()
    from tests.helpers.models import tiny

    run = _run(Request.from_config(cfg).settings, group)
    try:
        from_script = _wrapper(run.model(tiny(num_classes=4)))
    finally:
        run.close()
        activate(None)
    d = cfg.ddp
    assert from_job == from_script == {
        "bucket_bytes": int(d.bucket_cap_mb * 1024 * 1024), "gradient_as_bucket_view": d.gradient_as_bucket_view,
        "static_graph": d.static_graph, "find_unused_parameters": False, "broadcast_buffers": True,
        "device_ids": None, "channels_last": cfg.training.channels_last}
