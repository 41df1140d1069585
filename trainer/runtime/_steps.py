"""A run's model and its steps: the module placed, wrapped in DDP and compiled as the trial says; each micro-step under
autocast and DDP's ``no_sync``, the optimizer step through the GradScaler, clipping and backward right under every
precision and accumulation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.apply import (
    autocast,
    compile_script_model,
    grad_scaler,
    grad_sync,
    place,
    prepare_optimizer,
    takes_layout,
    wrap_ddp,
)
from trainer.config import DDPConfig
from trainer.knobs import table
from trainer.runtime._base import _UNSET, DDP_WRAPPER
from trainer.runtime._measure import Measurement
from trainer.runtime._settings import Settings


class Steps:
    """The model and steps part of a run (``trainer.runtime._run.Run``): ``run.model``, ``run.step`` and what a step
    holds (the optimizer, the GradScaler, the micro-steps of an optimizer step)."""

    def __init__(self, settings: Settings, measure: Measurement, device: torch.device,
                 *, on_close: Callable[[Callable[[], None]], None]):
        self._settings, self._measure, self._device, self._on_close = settings, measure, device, on_close
        self._model: torch.nn.Module | None = None
        self._module: torch.nn.Module | None = None
        self._optimizers: set[int] = set()
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._stepping = self._unscaled = False
        self._micro = 0
        self.stepped = False
        """Whether the latest ``run.step`` ended with an optimizer step."""

    def model(self, module: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """The module on the run's device, in channels_last when the run asks, wrapped in DistributedDataParallel
        with the run's bucket size, gradient-as-bucket-view and static-graph settings (a value given here is the
        script's default; other DDP arguments pass through), then torch.compile'd when the run asks. A module the
        script compiled itself (``torch.compile(net)``) is taken as the module inside, compile then the script's
        default; ``run.module`` is the script's module either way."""
        own_compile = _UNSET
        compiled = getattr(module, "_orig_mod", None)
        if isinstance(compiled, torch.nn.Module):
            # The script compiled its own module: the run compiles the DDP wrapper instead (its all-reduces then
            # overlap the backward, as the built-in job's do), with the script's choice as compile's default.
            module, own_compile = compiled, True
        self._module = module
        module = self.layout(module)[0]
        apply = self._settings.apply
        wrapper = {table().by_runtime_name[name].path.partition(".")[2]: apply(name, ddp_kwargs.pop(name, _UNSET))
                   for name in DDP_WRAPPER}
        ddp = wrap_ddp(module, self._device, DDPConfig(**wrapper), **ddp_kwargs)
        self._model = ddp
        # Compile the DDP wrapper: Dynamo's DDPOptimizer splits the graph at bucket boundaries so the all-reduces
        # still overlap the backward pass (as the built-in job does).
        return self.compiled(ddp, own_compile)

    def layout(self, module: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
        """The module on the run's device, in channels_last when the run asks; returns it and whether its inputs go
        channels_last too. A language model (no image-shaped weights) does not apply a layout, so its trials do not
        search it."""
        channels_last = takes_layout(module) and bool(self._settings.apply("channels_last"))
        return place(module, self._device, channels_last=channels_last), channels_last

    def compiled(self, module: torch.nn.Module, default: Any = _UNSET) -> torch.nn.Module:
        """``module`` under torch.compile when the run asks (``default``: the script's own choice), with its mode;
        Dynamo's caches are reset when the run ends."""
        if not self._settings.apply("compile", default):
            return module
        self._on_close(torch._dynamo.reset)
        return compile_script_model(module, self._settings.apply("compile_mode"))

    def release(self) -> None:
        """The model and optimizer let go (the run ended)."""
        self._model = self._module = self._optimizer = self._scaler = None
        self._optimizers.clear()

    @property
    def module(self) -> torch.nn.Module | None:
        """The script's own module inside what ``run.model`` returned (no DDP wrapper, no compile): for its
        ``state_dict``, its parameters by their own names (optimizer groups), its attributes."""
        return self._module

    @contextlib.contextmanager
    def step(self, optimizer: torch.optim.Optimizer, scheduler=None) -> Iterator[None]:
        """One micro-step: its forward (and ``backward``) under autocast at the run's precision, inside DDP's
        ``no_sync()`` unless it is the last micro-step of an optimizer step (so gradients are all-reduced once per
        optimizer step); after the last: the optimizer step through the GradScaler (fp16), then ``zero_grad``, then
        ``scheduler.step()`` when given (once per optimizer step, whatever the accumulation). ``run.stepped`` says
        whether this micro-step ended with an optimizer step (for a scheduler or EMA of the script's own)."""
        accum = max(1, int(self._settings.apply("accum_steps")))
        amp = autocast(self._settings.apply("precision"), self._device)
        self._prepare(optimizer)
        self._measure.ready()
        final = self._micro % accum == accum - 1
        self._stepping, self._optimizer, self._unscaled, self.stepped = True, optimizer, False, False
        try:
            with grad_sync(self._model, final=final), amp:
                yield
        finally:
            self._stepping = False
        self.micro_step(stepped=final)
        if final:
            if self._scaler is not None:
                self._scaler.step(optimizer)
                self._scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None and not self._schedule_ended(scheduler):
                scheduler.step()
            self.stepped = True

    def _schedule_ended(self, scheduler) -> bool:
        """Whether a trial has run ``scheduler`` to its end: a schedule of a fixed length (OneCycleLR's
        ``total_steps``) built from the script's epochs ends before a trial that runs epochs until it is measured
        (``epochs``), and stepping it further raises. It then holds its last rate; outside a search the script's
        own schedule is left as it is."""
        total = getattr(scheduler, "total_steps", None)
        return self._settings.in_search and isinstance(total, int) and scheduler.last_epoch >= total

    def micro_step(self, *, stepped: bool | None = None) -> None:
        """A micro-step (a forward and backward) has ended; ``stepped``: whether the optimizer stepped after it
        (None: every ``accum_steps``-th micro-step does). ``run.step`` calls it; a framework's loop, which steps
        on its own schedule (at an epoch's last batch too, cutting a group of micro-batches short), calls it before
        ``report()``, which counts an optimizer step where one ended."""
        accum = self._settings.accum
        # report() counts a step when the micro-steps are a multiple of accum: a step taken early jumps to the next.
        self._micro = (self._micro // accum + 1) * accum if stepped else self._micro + 1

    @property
    def final_micro_step(self) -> bool:
        """Inside ``run.step``: whether this micro-step ends an optimizer step (its gradients are then complete)."""
        accum = self._settings.accum
        return self._micro % accum == accum - 1

    @property
    def accumulating(self) -> bool:
        """Whether the micro-steps so far end inside an optimizer step (``report()`` counts none there)."""
        return self._micro % self._settings.accum != 0

    def clip_grad_norm_(self, max_norm: float, parameters=None, **kwargs: Any) -> torch.Tensor | None:
        """``torch.nn.utils.clip_grad_norm_`` after ``run.backward`` inside ``run.step``, right under every
        precision and accumulation: on the last micro-step only (earlier ones hold part of the gradient), after the
        GradScaler's ``unscale_`` under fp16 (else the norm is of scaled gradients). ``parameters``: the
        optimizer's by default. Returns the total norm, None on a micro-step that does not step."""
        if not self._stepping:
            raise RuntimeError("run.clip_grad_norm_(...) belongs inside `with run.step(optimizer):`, after "
                               "run.backward(loss)")
        if not self.final_micro_step:
            return None
        if self._scaler is not None and not self._unscaled:
            self._scaler.unscale_(self._optimizer)
            self._unscaled = True
        if parameters is None:
            parameters = [p for group in self._optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for a micro-step inside ``step``: divided over the micro-steps, scaled under fp16,
        outside autocast (backward runs in the forward's types anyway)."""
        if not self._stepping:
            raise RuntimeError("run.backward(loss) belongs inside `with run.step(optimizer):`")
        loss = loss / self._settings.accum
        with torch.autocast(self._device.type, enabled=False):
            (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def _prepare(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._optimizers:
            return
        self._optimizers.add(id(optimizer))
        if self._scaler is None:
            self._scaler = grad_scaler(self._settings.applied("precision"), self._device)
        # The fused SGD kernel leaves its momentum buffers uninitialized when the GradScaler skips the very first
        # step; zeros make its first update equal stock SGD's (trainer.apply.init_momentum_buffers).
        prepare_optimizer(optimizer)
