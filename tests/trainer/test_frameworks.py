"""The Lightning and Accelerate adapters in-process (a world of one on gloo): each setting a trial sets reaches the
framework's own object — the Trainer's precision plugin, accumulation and DDPStrategy, the Accelerator's mixed
precision, accumulation and DDP kwargs, the train loader's batch and workers — outside a search the script's own
arguments stand, every training batch is reported into the run's meter and the fit stops once the trial is
measured; the train loader the framework iterates is the run's (its supply and ceiling measured through the fit or
the loop, an image pipeline for a Lightning DataModule, channels_last inputs); a trial leaves no checkpoint and no
log folder outside its own; and a missing framework is one line naming its install."""

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
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, TensorDataset
from torchvision import datasets
from torchvision.transforms import v2

from trainer.config import MeasureConfig
from trainer.protocol import ResultWriter
from trainer.records import Dist
from trainer.runtime._base import ScriptError, TrialDone
from trainer.runtime._batches import samples_per_rank
from trainer.runtime.request import Active, Request, activate

pl = pytest.importorskip("lightning.pytorch")
accelerate = pytest.importorskip("accelerate")

from trainer.runtime import accelerate as tuned_accelerate  # noqa: E402
from trainer.runtime import lightning as tuned_lightning  # noqa: E402

MEASURE = MeasureConfig(warmup_min_steps=2, window_s=0.2, precision=0.05, max_s=0.8, warmup_max_s=20)
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
    """The adapter's run as a live worker's trial would start it: the request, the record stream (in the trial's
    folder, ``tmp_path``), the group."""
    tmp_path.mkdir(parents=True, exist_ok=True)
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
    def __init__(self, classes: int = 2, size: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * (size - 2) ** 2, classes))
        self.seen_channels_last, self.seen, self.validated = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_channels_last.append(x.is_contiguous(memory_format=torch.channels_last))
        self.seen.append(x)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.validated.append(batch[0].shape)

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
    assert 0.0 <= summary["data_wait_share"] < 1.0  # Lightning's waits for the run's batches are timed
    # The meter counts Lightning's optimizer steps: every 3 micro-batches, and at each epoch's last (16 batches).
    assert run.steps == trainer.global_step
    windows = [r for r in got if r["kind"] == "window"]
    assert windows and all(w["steps"] * 4 <= w["images"] <= w["steps"] * 3 * 4 for w in windows)
    settings = next(r for r in got if r["kind"] == "settings")
    assert {"precision", "accum_steps", "batch_size", "num_workers", "bucket_cap_mb", "channels_last"} <= \
        set(settings["applied"])
    # Its train loader is the run's: a search may measure it alone and replay its first batch (stages).
    assert settings["loader"] is True and settings["samples_per_rank"] == 64


class LossNet(Net):
    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def test_a_lightning_fit_reports_its_training_steps_own_loss_under_accumulation(tmp_path, ended):
    # Lightning's on_train_batch_end gets the loss divided by accumulate_grad_batches: on 1xH200 the Lightning
    # search's trials at accumulation 2 read 2.3 where the same model at 1 read 4.5.
    run = started(tuned_lightning, tmp_path, settings={"batch_size": 4, "accum_steps": 3}, unit="images")
    ended(run)
    trainer = run.trainer(max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=False, logger=False)
    module = run.module(LossNet())
    trainer.fit(module, datamodule=run.datamodule(Data()))
    assert float(run.run.loss) == pytest.approx(module.losses[-1], rel=1e-5)


def test_a_lightning_supply_measures_the_train_loader_alone_inside_the_fit(tmp_path, ended):
    run = started(tuned_lightning, tmp_path, mode="supply", settings={"batch_size": 4, "num_workers": 1},
                  unit="images")
    ended(run)
    trainer = run.trainer(max_epochs=1)
    module = run.module(Net())
    with pytest.raises(TrialDone):  # the trial ends inside the fit's first fetch
        trainer.fit(module, datamodule=run.datamodule(Data()))
    assert module.seen == []  # not one training step: the model unused
    got = records(tmp_path)
    summary = next(r for r in got if r["kind"] == "summary")
    assert summary["mode"] == "loader" and summary["imgs_per_s"] > 0
    windows = [r for r in got if r["kind"] == "window"]
    assert windows and all(w["images"] == 4 * w["steps"] for w in windows)


def test_a_lightning_ceiling_replays_the_first_batch_through_the_fit(tmp_path, ended):
    run = started(tuned_lightning, tmp_path, mode="ceiling", settings={"batch_size": 16}, unit="images")
    ended(run)
    trainer = run.trainer(max_epochs=1)
    module = run.module(Net())
    trainer.fit(module, datamodule=run.datamodule(Data()))
    assert run.done and trainer.should_stop
    # One batch, on the device, stepped on in one endless epoch: no loader, no epoch boundary in the windows.
    assert len(module.seen) > 4 and all(x is module.seen[0] for x in module.seen)
    assert trainer.current_epoch == 1  # the one epoch, ended by the trial: longer than the loader's 4 batches
    summary = next(r for r in records(tmp_path) if r["kind"] == "summary")
    assert summary["mode"] == "measure" and summary["imgs_per_s"] > 0 and summary["loss_finite"] is True


def test_a_lightning_trial_saves_no_checkpoint_and_keeps_its_logs_in_its_folder(tmp_path, ended, monkeypatch):
    cwd, trial = tmp_path / "cwd", tmp_path / "trial-3"
    cwd.mkdir(), trial.mkdir()
    monkeypatch.chdir(cwd)
    run = started(tuned_lightning, trial, settings={"batch_size": 4}, unit="images")
    ended(run)
    trainer = run.trainer(max_epochs=1, callbacks=[pl.callbacks.ModelCheckpoint(dirpath=cwd / "checkpoints")])
    trainer.fit(run.module(Net()), datamodule=run.datamodule(Data()))
    assert run.done
    assert list(cwd.iterdir()) == [] and (trial / "lightning_logs").is_dir() and not list(trial.rglob("*.ckpt"))


class Images(pl.LightningDataModule):
    """An ImageFolder with the ImageNet recipe for training, and a validation loader of its own."""

    def __init__(self, root, size: int = 16):
        super().__init__()
        self.root, self.size = root, size

    def setup(self, stage: str):
        self.train = datasets.ImageFolder(self.root, transform=v2.Compose([
            v2.RandomResizedCrop(self.size), v2.RandomHorizontalFlip(), v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]))
        self.val = datasets.ImageFolder(self.root, transform=v2.Compose([
            v2.Resize((10, 10)), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=6, shuffle=True, num_workers=0, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=5)


@pytest.mark.parametrize("mode", ["plain", "measure"])
def test_an_image_folder_datamodule_trains_on_the_runs_image_pipeline(tmp_path, ended, tiny_jpegs, mode):
    settings = {"batch_size": 4, "decode": "torchvision-cpu", "channels_last": True} if mode == "measure" else {}
    run = started(tuned_lightning, tmp_path, mode=mode, settings=settings, unit="images")
    ended(run)
    data = run.datamodule(Images(tiny_jpegs), image_folder=tiny_jpegs, image_size=16)
    module = run.module(Net(classes=3, size=16))
    trainer = run.trainer(max_epochs=1, default_root_dir=tmp_path / "own", limit_val_batches=2,
                          num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    assert module.seen and all(x.shape[1:] == (3, 16, 16) for x in module.seen)
    if mode == "plain":
        # The script's DataLoader's batch of 6 is the default; its one epoch of 36 images; its validation its own.
        assert [len(x) for x in module.seen] == [6] * 6 and run.settings()["decode"] == "pil"
        assert module.validated == [(5, 3, 10, 10)] * 2
    else:
        assert run.done and {len(x) for x in module.seen} == {4} and all(module.seen_channels_last)
        assert module.validated == []  # a trial times training alone
        assert next(r for r in records(tmp_path) if r["kind"] == "settings")["applied"]["decode"] == \
            "torchvision-cpu"


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
    assert all(w["wait_s"] is not None for w in windows)  # the prepared loader's batches are timed


@pytest.mark.parametrize(("framework", "module"), [("lightning", "lightning"), ("accelerate", "accelerate")])
def test_a_missing_framework_is_one_line_naming_its_install(monkeypatch, framework, module):
    from trainer.runtime._base import ScriptError

    monkeypatch.setitem(sys.modules, module, None)  # what an import of a package that is not installed raises
    monkeypatch.delitem(sys.modules, f"trainer.runtime.{framework}", raising=False)
    with pytest.raises(ScriptError, match=rf"pip install 'ddp-autotune\[{framework}\]'"):
        importlib.import_module(f"trainer.runtime.{framework}")


def accelerate_loop(run, accelerator, model, loader, seen: list) -> None:
    """The example's loop: ``accumulate``, ``backward``, a step, a report of the batch's tokens."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in run.epochs(1):
        for tokens in loader:
            seen.append(tokens)
            with accelerator.accumulate(model):
                loss = model(tokens[:, :-1].float()).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if run.report(tokens[:, 1:].numel(), loss):
                break


def test_an_accelerate_supply_and_ceiling_measure_the_prepared_loader_in_the_loops_unit(tmp_path, ended):
    tokens = torch.randint(0, 9, (128, 9))
    count = lambda batch: batch[:, 1:].numel()  # the loop's tokens, not its sequences
    run = started(tuned_accelerate, tmp_path / "supply", mode="supply", settings={"batch_size": 8})
    ended(run)
    accelerator = run.accelerator(samples=count)
    loader = accelerator.prepare(DataLoader(tokens, batch_size=16, shuffle=True))
    seen = []
    with pytest.raises(TrialDone):  # the trial ends inside the loop's first fetch
        accelerate_loop(run, accelerator, nn.Linear(8, 1), loader, seen)
    assert seen == []
    windows = [r for r in records(tmp_path / "supply") if r["kind"] == "window"]
    assert windows and all(w["images"] == 8 * 8 * w["steps"] for w in windows)  # tokens, as the loop reports
    run.close()

    run = started(tuned_accelerate, tmp_path / "ceiling", mode="ceiling", settings={"batch_size": 8})
    ended(run)
    accelerator = run.accelerator(samples=count)
    loader = accelerator.prepare(DataLoader(tokens, batch_size=16, shuffle=True))
    seen = []
    accelerate_loop(run, accelerator, nn.Linear(8, 1), loader, seen)
    assert run.done and len(seen) > len(loader) and all(t is seen[0] for t in seen)  # the first batch, replayed
    assert next(r for r in records(tmp_path / "ceiling") if r["kind"] == "settings")["loader"] is True


def test_a_loader_that_counts_other_samples_than_the_steps_report_is_refused_with_the_fix(tmp_path, ended):
    run = started(tuned_accelerate, tmp_path, settings={"batch_size": 8})
    ended(run)
    accelerator = run.accelerator()  # no samples=: the loader counts sequences, the loop reports tokens
    loader = accelerator.prepare(DataLoader(torch.randint(0, 9, (64, 9)), batch_size=8))
    with pytest.raises(ScriptError, match=r"reported 64 samples, but the loader counts 8 .* samples=lambda batch"):
        accelerate_loop(run, accelerator, nn.Linear(8, 1), loader, [])


def test_accelerate_hands_an_image_model_its_batches_in_channels_last_and_leaves_the_eval_loader_alone(tmp_path,
                                                                                                         ended):
    run = started(tuned_accelerate, tmp_path, settings={"batch_size": 4, "channels_last": True}, unit="images")
    ended(run)
    accelerator = run.accelerator()
    data = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 2, (32,)))
    model, train, val = accelerator.prepare(Net().net, DataLoader(data, batch_size=8), DataLoader(data, batch_size=5))
    assert model.module[0].weight.is_contiguous(memory_format=torch.channels_last)
    x, _ = next(iter(train))
    assert x.is_contiguous(memory_format=torch.channels_last) and len(x) == 4  # the run's batch, in its layout
    assert len(next(iter(val))[0]) == 5 and not isinstance(val, type(train))  # the script's own, as prepared


def test_samples_per_rank_takes_a_distributed_samplers_length_and_else_the_dataset_over_the_ranks():
    data = TensorDataset(torch.zeros(10, 1))
    # A DistributedSampler's length is one rank's share; any other sampler's (Accelerate shards the batches of a
    # loader whose sampler still spans the whole dataset) is not: the dataset over the ranks instead.
    assert samples_per_rank(DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0)), 2) == 5
    assert samples_per_rank(DataLoader(data, sampler=RandomSampler(data)), 2) == 5
    assert samples_per_rank(DataLoader(data, batch_size=2), 4) == 2

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    assert samples_per_rank(DataLoader(Stream()), 2) is None
