"""Where a run's settings take effect, for the built-in job (``trainer.job``) and a user's script
(``trainer.runtime``) alike:

- the process: the safety and NCCL environment, the process group (``init_distributed`` for the built-in job,
  ``script_distributed`` for a script, which may have started its own; ``group_of_the_worker`` for a script's
  function on a live worker, whose own ``init_process_group`` is accepted);
- the input: the DataLoader's arguments (``loader_args``, ``data_loader``), one rule for settings that need workers
  or CUDA;
- the model: device and memory layout (``place``), the DDP wrapper (``wrap_ddp``), torch.compile;
- the step: autocast and the GradScaler for a precision, the optimizer's state before its first step, gradient sync
  under accumulation, cuDNN's algorithm search.

Each function takes the values or a config section, never a knob's name: the built-in job passes its TrainConfig's,
the runtime the trial's (or the script's own defaults), and both get the same DataLoader, wrapper and step for the
same settings. What a compiled graph is keyed by, and the cache a live worker keeps, is ``trainer.compiled``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from trainer.compiled import compile_model
from trainer.config import ConfigError, DDPConfig, LoaderConfig, TrainConfig
from trainer.protocol import SAFETY_ENV, nccl_env_problems
from trainer.records import Dist

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``training.precision`` values that run the forward pass under autocast, and its dtype (fp32: none)."""


# ---- the process ---------------------------------------------------------------------------------------------------


def apply_env(cfg: TrainConfig | None = None) -> None:
    """The safety environment and the config's NCCL variables (none for a script: the launcher sets them). NCCL
    reads its variables when the first communicator is made, so setting them here, before init, works for a job
    started by hand as well as by the tuner (which sets them too)."""
    problems = nccl_env_problems({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    if problems:
        raise ConfigError([f"environment: {p}" for p in problems])
    os.environ.update(SAFETY_ENV)
    if cfg is not None:
        os.environ.update(cfg.nccl.to_env())


def init_distributed(cfg: TrainConfig) -> Dist:
    """The built-in job's process: the safety environment, NCCL variables and the process group, everything a live
    process cannot change later (``trainer.config.process_settings``)."""
    apply_env(cfg)
    _world_of_one()
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = cfg.ddp.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(["ddp.backend=nccl needs CUDA GPUs: use auto or gloo on this machine"])
        device = _cuda_device(local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads()))
    return _process_group(backend, device, local_rank, timeout_s=cfg.ddp.timeout_s)


def script_distributed() -> Dist:
    """A user's script's process: the safety environment, and the process group the script started, else one
    started as the built-in job's would be (NCCL on GPUs, gloo on the CPU, the default timeout)."""
    apply_env()
    _world_of_one()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = _cuda_device(local_rank) if cuda else torch.device("cpu")
    return _process_group("nccl" if cuda else "gloo", device, local_rank, timeout_s=DDPConfig().timeout_s)


@contextlib.contextmanager
def group_of_the_worker():
    """While a live worker runs a user's function (``script.entry``): the process group is the worker's, so the
    function's own ``dist.init_process_group(...)`` (the first lines of many scripts, which run unchanged under plain
    torchrun) is accepted as a no-op when a group exists, and its ``dist.destroy_process_group()`` leaves the
    worker's group standing for the next trial. A function that imported them by name (``from torch.distributed
    import init_process_group``) before the worker started keeps torch's own and gets its error
    (``OWN_GROUP_FIX``)."""
    started, destroyed = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            started(*args, **kwargs)

    def destroy_process_group(group=None) -> None:
        if group is not None and group is not dist.group.WORLD:
            destroyed(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = started, destroyed


OWN_GROUP_FIX = ("the script starts its own process group, but as a function (`:main`) it runs in the worker's: "
                 "guard the call, `if not dist.is_initialized(): dist.init_process_group(...)`, or run the script "
                 "file without `:main`")
"""The fix for torch's "trying to initialize the default process group twice" from a function on a live worker."""


def shutdown_distributed() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _world_of_one() -> None:
    if "RANK" not in os.environ:  # `python -m trainer` or `python train.py` without torchrun: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))


def _cuda_device(local_rank: int) -> torch.device:
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _process_group(backend: str, device: torch.device, local_rank: int, *, timeout_s: float) -> Dist:
    """The process group started on ``backend`` unless one exists (a script's own), and this process's place in
    it."""
    t0 = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    else:
        backend = dist.get_backend()
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device,
                backend=backend, init_s=round(time.perf_counter() - t0, 4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the input -----------------------------------------------------------------------------------------------------


DATALOADER_PREFETCH = 2
"""The prefetch depth DataLoader uses when it has workers and is given none."""


def loader_settings(*, num_workers: int, prefetch_factor: int | None = None, pin_memory: bool = False,
                    persistent_workers: bool = False) -> LoaderConfig:
    """Loader settings a DataLoader accepts: without workers there is no prefetch depth and no worker to keep
    alive (DataLoader refuses either), so both are cleared rather than refused."""
    return LoaderConfig(num_workers=num_workers, prefetch_factor=prefetch_factor if num_workers else None,
                        pin_memory=bool(pin_memory), persistent_workers=bool(persistent_workers) and num_workers > 0)


def loader_args(loader: LoaderConfig, device: torch.device) -> dict[str, Any]:
    """The DataLoader keyword arguments of ``loader`` on ``device``: what needs workers cleared without any
    (``loader_settings``), pinned memory only where there is a CUDA device to copy to."""
    fitted = loader_settings(num_workers=loader.num_workers, prefetch_factor=loader.prefetch_factor,
                             pin_memory=loader.pin_memory, persistent_workers=loader.persistent_workers)
    return {"num_workers": fitted.num_workers, "prefetch_factor": fitted.prefetch_factor,
            "pin_memory": fitted.pin_memory and device.type == "cuda", "persistent_workers": fitted.persistent_workers}


_BUILT: weakref.WeakSet = weakref.WeakSet()


def data_loader(dataset, loader: LoaderConfig, device: torch.device, **kwargs: Any) -> DataLoader:
    """``DataLoader(dataset, **kwargs)`` with ``loader``'s settings applied (``loader_args``)."""
    built = DataLoader(dataset, **loader_args(loader, device), **kwargs)
    _BUILT.add(built)
    return built


def applied_here(loader: DataLoader) -> bool:
    """Whether ``loader`` was built by ``data_loader`` (with a run's settings): not one of a script's own."""
    return loader in _BUILT


# ---- the model -----------------------------------------------------------------------------------------------------


def takes_layout(module: nn.Module) -> bool:
    """A memory layout only means something to a model with image-shaped (4-D) weights."""
    return any(p.ndim == 4 for p in module.parameters())


def place(module: nn.Module, device: torch.device, *, channels_last: bool) -> nn.Module:
    """The module on ``device``, in channels_last when asked."""
    module = module.to(device)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    return module


def ddp_args(ddp: DDPConfig) -> dict[str, Any]:
    """DistributedDataParallel's keyword arguments of ``ddp``'s wrapper settings. ``broadcast_buffers`` is passed
    only when changed: torch >= 2.14 deprecates the argument."""
    args = {"bucket_cap_mb": ddp.bucket_cap_mb, "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph, "find_unused_parameters": ddp.find_unused_parameters}
    if not ddp.broadcast_buffers:
        args["broadcast_buffers"] = False
    return args


def wrap_ddp(module: nn.Module, device: torch.device, ddp: DDPConfig, **other: Any) -> DistributedDataParallel:
    """``module`` (already on ``device``) in DistributedDataParallel with ``ddp``'s wrapper settings; ``other``: more
    DDP arguments, which win over the settings' (a script's own)."""
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                   **{**ddp_args(ddp), **other})


def compile_script_model(model: nn.Module, mode: str | None) -> nn.Module:
    """A script's model under torch.compile with the run's mode and torch's own shape handling (the built-in job
    compiles with static shapes, for the graphs a live worker reuses: ``trainer.compiled``)."""
    return torch.compile(model, mode=mode)


def prepare_model(model: nn.Module, cfg: TrainConfig, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """The built-in job's model as its config says: placed, wrapped in DDP, compiled. Returns ``(the model to train,
    the module inside it)``. The DDP wrapper is what is compiled: Dynamo's DDPOptimizer splits the graph at bucket
    boundaries so the all-reduces still overlap the backward pass."""
    raw = place(model, device, channels_last=cfg.training.channels_last)
    wrapped = wrap_ddp(raw, device, cfg.ddp)
    return (compile_model(wrapped, cfg) if cfg.training.compile else wrapped), raw


# ---- the step ------------------------------------------------------------------------------------------------------


def autocast(precision: str, device: torch.device):
    """The forward pass's context for ``precision``: autocast to its dtype, nothing for fp32."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    # bf16 has fp32's exponent range, so only fp16 needs loss scaling.
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def grad_sync(model: nn.Module, *, final: bool):
    """The context of one micro-step's forward and backward: inside DDP's ``no_sync()`` unless it is the last of an
    optimizer step, so gradients are all-reduced once per optimizer step, not once per micro-batch."""
    return contextlib.nullcontext() if final or not hasattr(model, "no_sync") else model.no_sync()


def cudnn_benchmark(value: bool | None) -> bool:
    """cuDNN's per-shape algorithm search on (or off) for the process when ``value`` says; None leaves the choice
    already made (the script's, or torch's). Returns what stands."""
    if value is not None:
        torch.backends.cudnn.benchmark = bool(value)
    return bool(torch.backends.cudnn.benchmark)


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """What an optimizer needs before its first step: fused SGD (without dampening) its momentum buffers as zeros
    (``init_momentum_buffers``)."""
    if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("fused") and \
            optimizer.defaults.get("dampening", 0) == 0:
        init_momentum_buffers(optimizer)


def init_momentum_buffers(optimizer: torch.optim.SGD) -> None:
    """Create SGD's momentum buffers as zeros before the first step.

    The fused SGD kernel allocates the buffers uninitialized (``torch.empty_like``) on its first call and fills them
    only when that step runs. Under a GradScaler the first fp16 steps usually overflow and are skipped *on the
    device*, so the first call leaves the buffers holding whatever memory they got, and every later step pours it
    into the weights (an fp16 run's loss turns NaN within its first steps). Zeros make the kernel's ordinary update
    ``buf = momentum * buf + grad`` equal stock SGD's first step ``buf = grad`` (no dampening), and a skipped step
    leaves them zero, as stock SGD leaves them absent."""
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        if group["dampening"] != 0:
            raise ValueError("init_momentum_buffers: with dampening the first step differs from stock SGD's")
        for p in group["params"]:
            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
