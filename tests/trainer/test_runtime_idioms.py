"""The usual loop idioms of a user's script through the runtime (``trainer.runtime``), in-process on a process group
of one (gloo): gradient clipping under fp16 and accumulation, a scheduler stepped once per optimizer step, the
script's own optimizer groups, a module the script compiled itself, a ``:main`` function's own
``init_process_group`` on a live worker's group, and a trial that leaves torch's ``DataLoader`` as it found it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import apply
from trainer.apply import group_of_the_worker, script_distributed
from trainer.config import MeasureConfig
from trainer.protocol import ResultWriter
from trainer.runtime import _steps, setup
from trainer.runtime._run import Run
from trainer.runtime.request import Active, Request, activate


@pytest.fixture(scope="module")
def group():
    saved = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    try:
        yield script_distributed()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def make_run(group):
    made = []

    def make(**settings) -> Run:
        run = Run(Request(mode="plain", settings=settings), {}, unit="samples", writer=ResultWriter(None, 0),
                  env=group)
        made.append(run)
        return run

    yield make
    for run in made:
        run.close()
    activate(None)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


X, Y = torch.randn(6, 4) * 3, torch.randn(6, 2)


def test_clipping_under_fp16_sees_unscaled_gradients_and_only_on_the_step_that_steps(make_run, monkeypatch):
    # The reference: the same step in fp32, without a scaler; its gradients' norm is what clipping must see.
    ref = net()
    nn.functional.mse_loss(ref(X), Y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    run = make_run(precision="fp16", accum_steps=2)
    # A scale whose scaled gradients fit fp16 on the first step (the default 2**16 overflows it, then skips it).
    scalers = []
    monkeypatch.setattr(_steps, "grad_scaler", lambda precision, device: scalers.append(
        torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)) or scalers[-1])
    model = run.model(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    norms = []
    for x, y in ((X[:3], Y[:3]), (X[3:], Y[3:])):
        with run.step(optimizer):
            loss = nn.functional.mse_loss(model(x).float(), y)
            run.backward(loss)
            norms.append(run.clip_grad_norm_(1.0))
    assert norms[0] is None  # half a gradient: nothing to clip yet
    assert len(scalers) == 1 and scalers[0].get_scale() > 1  # the loss was scaled ...
    assert float(norms[1]) == pytest.approx(float(expected), rel=0.05)  # ... the norm clipped was not
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it stepped


def test_a_scheduler_steps_once_per_optimizer_step_under_accumulation(make_run):
    run = make_run(accum_steps=2)
    model = run.model(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    stepped = []
    for _ in range(6):
        with run.step(optimizer, scheduler):
            run.backward(nn.functional.mse_loss(model(X), Y))
        stepped.append(run.stepped)
    assert stepped == [False, True] * 3
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_the_scripts_own_optimizer_groups_by_its_own_parameter_names(make_run):
    run = make_run()
    model = run.model(net())
    names = dict(run.module.named_parameters())  # the script's names, not DDP's "module.0.weight"
    assert set(names) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    decay = [p for n, p in names.items() if n.endswith("weight")]
    no_decay = [p for n, p in names.items() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                                            "lr": 1e-2}], lr=1e-3)
    before = {n: p.detach().clone() for n, p in names.items()}
    with run.step(optimizer):
        run.backward(nn.functional.mse_loss(model(X), Y))
    assert all(not torch.equal(before[n], p) for n, p in names.items())  # both groups stepped


def test_a_module_the_script_compiled_itself_is_compiled_once_as_the_run_says(make_run, monkeypatch):
    compiled = []
    monkeypatch.setattr(_steps, "compile_script_model", lambda model, mode: compiled.append(model) or model)
    own = net()
    # Asked not to compile: the module inside, wrapped in DDP, nothing compiled.
    run = make_run(compile=False)
    model = run.model(torch.compile(own))
    assert model.module is own and run.module is own and compiled == [] and run.settings()["compile"] is False
    # Nothing asked: the script's own choice (compile) stands, applied to the DDP wrapper as the knob does.
    run = make_run()
    model = run.model(torch.compile(own))
    assert compiled and compiled[0].module is own and run.settings()["compile"] is True


def test_a_functions_own_init_process_group_is_accepted_on_the_workers_group(group):
    world = dist.group.WORLD
    with group_of_the_worker():
        dist.init_process_group("gloo")  # what the script's first lines do: the group exists, accepted
        dist.destroy_process_group()  # and at its end: the worker's group stays for the next trial
        assert dist.is_initialized() and dist.group.WORLD is world
    assert dist.init_process_group is apply.dist.init_process_group  # torch's own again
    with pytest.raises(ValueError, match="twice"):
        dist.init_process_group("gloo")


def test_an_image_loader_with_workers_records_the_prefetch_depth_its_dataloader_uses(make_run, tiny_jpegs):
    """A script that gives workers but no prefetch depth runs DataLoader's own (2): trial 0's settings record that,
    not None (a search once noted "trial 0 ran the script's loader.prefetch_factor=None")."""
    run = make_run()
    loader = run.image_loader(str(tiny_jpegs), image_size=32, batch_size=4, num_workers=1)
    next(iter(loader))
    assert run.settings()["prefetch_factor"] == 2


def test_a_one_cycle_schedule_holds_its_end_in_a_trial_longer_than_the_scripts_epochs(group):
    """A search's trial runs epochs until it is measured (``run.epochs``), past the steps a OneCycleLR was built for
    from the script's own epochs: its ``step()`` raised "Tried to step 10626 times. The specified number of total
    steps is 10625" and the trial crashed. In a trial the schedule holds its last rate; outside one the script's own
    schedule is left as it is."""
    run = Run(Request(mode="measure", settings={}), {}, unit="samples", writer=ResultWriter(None, 0), env=group)
    try:
        model = run.model(net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=5)
        rates = []
        for _ in range(12):
            with run.step(optimizer, scheduler):
                run.backward(nn.functional.mse_loss(model(X), Y))
            rates.append(optimizer.param_groups[0]["lr"])
        assert scheduler.last_epoch == 5 and len(set(rates[4:])) == 1 and len(set(rates[:5])) == 5
    finally:
        run.close()
        activate(None)


def test_a_trials_dataloader_hook_is_gone_once_its_first_step_is_checked_and_once_it_ends(group):
    """A trial notes every DataLoader its script iterates (one the script built itself must use the loader settings
    it reads from the run, checked at the first report) by wrapping ``DataLoader.__iter__``: the wrapper stayed on
    for the whole process until the run closed, and where two runs overlapped, the second's close put the first's
    wrapper back for good. Torch's own is back once the first report has read it, and once every trial ended."""
    original = DataLoader.__iter__

    def trial() -> Run:  # as a live worker starts one
        request = Request(mode="measure", settings={}, measure=MeasureConfig(warmup_min_steps=2))
        activate(Active(request=request, writer=ResultWriter(None, 0), env=group))
        return setup()

    try:
        first, second = trial(), trial()
        assert DataLoader.__iter__ is not original  # watching
        first.close()
        second.close()
        assert DataLoader.__iter__ is original
        run = trial()
        loader = run.loader(TensorDataset(torch.randn(8, 4)), batch_size=4)
        (x,) = next(iter(loader))
        assert DataLoader.__iter__ is not original  # the first step is not checked yet
        run.report(len(x))
        assert DataLoader.__iter__ is original
        run.close()
        assert DataLoader.__iter__ is original
    finally:
        DataLoader.__iter__ = original  # a failure here leaves the next tests torch's own
        activate(None)
