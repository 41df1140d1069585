"""The Lightning and Accelerate adapters in-process (a world of one on gloo): each setting a trial sets reaches the
framework's own object — the Trainer's precision plugin, accumulation and DDPStrategy, the Accelerator's mixed
precision, accumulation and DDP kwargs, the train loader's batch and workers — outside a search the script's own
arguments stand, every training batch is reported into the run's meter and the fit stops once the trial is
measured, and a missing framework is one line naming its install."""

from __future__ import annotations

import datetime
import importlib
import json
import socket
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.config import MeasureConfig
from trainer.protocol import ResultWriter
from trainer.records import Dist
from trainer.runtime.request import Active, Request, activate

pl = pytest.importorskip("lightning.pytorch")
accelerate = pytest.importorskip("accelerate")

from trainer.runtime import accelerate as tuned_accelerate  # noqa: E402
from trainer.runtime import lightning as tuned_lightning  # noqa: E402

MEASURE = MeasureConfig(warmup_min_steps=2, window_s=0.2, windows=2, max_windows=4, warmup_max_s=20)
TRIAL = {"precision": "bf16", "accum_steps": 2, "bucket_cap_mb": 5.0, "gradient_as_bucket_view": True,
         "static_graph": True, "batch_size": 4, "num_workers": 1, "prefetch_factor": 3, "pin_memory": True,
         "persistent_workers": True, "channels_last": True}


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """The process group a script's run joins (torchrun's world, here of one process)."""
    with pytest.MonkeyPatch.context() as mp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            mp.setenv(k, v)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        yield
        dist.destroy_process_group()


def started(module, tmp_path, mode="measure", settings=None, unit="samples"):
    """The adapter's run as a live worker's trial would start it: the request, the record stream, the group."""
    request = Request(mode=mode, settings=dict(TRIAL if settings is None else settings), measure=MEASURE,
                      result=str(tmp_path / "result.jsonl"))
    writer = ResultWriter(request.result, 0)
    env = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo", init_s=0.0)
    activate(Active(request=request, writer=writer, env=env))
    return module.setup(unit=unit)


@pytest.fixture
def ended():
    runs = []
    yield runs.append
    for run in runs:
        run.close()
    activate(None)


def records(tmp_path):
    path = tmp_path / "result.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class Data(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 2, (64,)))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8, shuffle=True, drop_last=True)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        self.seen_channels_last = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_channels_last.append(x.is_contiguous(memory_format=torch.channels_last))
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_each_trial_setting_reaches_the_lightning_trainer_its_loader_and_module(tmp_path, ended):
    run = started(tuned_lightning, tmp_path)
    ended(run)
    trainer = run.trainer(max_epochs=3, precision="32-true", default_root_dir=tmp_path)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert trainer.accumulate_grad_batches == 2
    strategy = trainer.strategy
    assert isinstance(strategy, pl.strategies.DDPStrategy)
    assert {k: strategy._ddp_kwargs[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")} == \
        {"bucket_cap_mb": 5.0, "gradient_as_bucket_view": True, "static_graph": True}
    loader = run.datamodule(Data()).train_dataloader()
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (4, 1, 3, True)
    assert loader.pin_memory is False and loader.drop_last is True  # pinned only with a CUDA device; drop_last kept
    module = run.module(Net())
    assert module.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    # A search's trial runs epochs until measured, without validation.
    assert trainer.max_epochs == -1 and trainer.limit_val_batches == 0


def test_outside_a_search_the_lightning_trainer_is_the_scripts_own(tmp_path, ended):
    run = started(tuned_lightning, tmp_path, mode="plain", settings={})
    ended(run)
    trainer = run.trainer(max_epochs=3, precision="16-mixed", accumulate_grad_batches=4, default_root_dir=tmp_path,
                          strategy=pl.strategies.DDPStrategy(find_unused_parameters=True))
    assert trainer.accumulate_grad_batches == 4 and trainer.max_epochs == 3
    kwargs = trainer.strategy._ddp_kwargs
    assert kwargs["find_unused_parameters"] is True and kwargs["bucket_cap_mb"] == 25.0  # DDP's own default
    loader = run.datamodule(Data()).train_dataloader()
    assert (loader.batch_size, loader.num_workers) == (8, 0)
    assert run.settings()["precision"] == "fp16"  # the script's 16-mixed, what a search starts from


def test_a_lightning_fit_reports_every_batch_and_stops_once_the_trial_is_measured(tmp_path, ended):
    run = started(tuned_lightning, tmp_path, settings={"batch_size": 4, "accum_steps": 3, "channels_last": True},
                  unit="images")
    ended(run)
    trainer = run.trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=False, logger=False)
    module = run.module(Net())
    trainer.fit(module, datamodule=run.datamodule(Data()))
    assert run.done and trainer.should_stop
    assert module.seen_channels_last and all(module.seen_channels_last)  # the inputs too, after Lightning moved them
    assert trainer.current_epoch >= 1  # the script's 1 epoch ran on until the trial was measured
    got = records(tmp_path)
    summary = next(r for r in got if r["kind"] == "summary")
    assert summary["imgs_per_s"] > 0 and summary["loss_finite"] is True
    # The meter counts Lightning's optimizer steps: every 3 micro-batches, and at each epoch's last (16 batches).
    assert run.steps == trainer.global_step
    windows = [r for r in got if r["kind"] == "window"]
    assert windows and all(w["steps"] * 4 <= w["images"] <= w["steps"] * 3 * 4 for w in windows)
    applied = next(r for r in got if r["kind"] == "settings")["applied"]
    assert {"precision", "accum_steps", "batch_size", "num_workers", "bucket_cap_mb", "channels_last"} <= set(applied)


def test_each_trial_setting_reaches_the_accelerator_and_its_prepared_loader(tmp_path, ended):
    run = started(tuned_accelerate, tmp_path, settings={**TRIAL, "channels_last": False})
    ended(run)
    accelerator = run.accelerator(mixed_precision="no")
    assert accelerator.mixed_precision == "bf16" and accelerator.gradient_accumulation_steps == 2
    assert accelerator.ddp_handler.bucket_cap_mb == 5.0 and accelerator.ddp_handler.static_graph is True
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model, optimizer = nn.Linear(4, 1), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8, shuffle=True))
    assert loader.base_dataloader.num_workers == 1 and loader.base_dataloader.prefetch_factor == 3
    assert loader.total_batch_size == 4
    assert isinstance(model, nn.parallel.DistributedDataParallel) and model.bucket_bytes_cap == 5 * 1024 * 1024


def test_an_accelerate_loop_reports_its_micro_batches_and_is_told_to_stop(tmp_path, ended):
    run = started(tuned_accelerate, tmp_path, settings={"batch_size": 8, "accum_steps": 3})
    ended(run)
    accelerator = run.accelerator()
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    model = nn.Linear(4, 1)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                                   DataLoader(data, batch_size=16))
    stopped, stepped = False, 0
    for _ in run.epochs(1):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            stepped += accelerator.sync_gradients
            if run.report(len(x), loss):
                stopped = True
                break
    assert stopped and run.done
    # The meter counts Accelerate's optimizer steps: every 3 micro-batches, and at the loader's end (32 batches).
    assert run.steps == stepped
    windows = [r for r in records(tmp_path) if r["kind"] == "window"]
    assert windows and all(w["steps"] * 8 <= w["images"] <= w["steps"] * 3 * 8 for w in windows)


@pytest.mark.parametrize(("framework", "module"), [("lightning", "lightning"), ("accelerate", "accelerate")])
def test_a_missing_framework_is_one_line_naming_its_install(monkeypatch, framework, module):
    from trainer.runtime._run import ScriptError

    monkeypatch.setitem(sys.modules, module, None)  # what an import of a package that is not installed raises
    monkeypatch.delitem(sys.modules, f"trainer.runtime.{framework}", raising=False)
    with pytest.raises(ScriptError, match=rf"pip install 'ddp-autotune\[{framework}\]'"):
        importlib.import_module(f"trainer.runtime.{framework}")
