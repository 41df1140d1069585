"""torchrun command lines and environments: every run the tuner starts (trial, worker, full run, re-measure) is
``python -m torch.distributed.run ... -m trainer`` (the built-in job, or a user's training function) or ``... SCRIPT
ARGS`` (a user's script file), built here.

Extra torchrun arguments from a spec or an export are read with torchrun's own parser, so ``--nnodes=2``,
``--nnodes 1:4``, ``--master_addr`` and ``--master-addr`` all mean what torchrun takes them to mean.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from autotune.exceptions import LaunchError
from trainer.config import TrainConfig
from trainer.protocol import SAFETY_ENV, nccl_env_problems
from trainer.runtime.request import ENV_REQUEST, Request


@dataclass(frozen=True, kw_only=True)
class Torchrun:
    """What the tuner needs to know of a list of extra torchrun arguments."""

    args: tuple[str, ...] = ()
    nnodes: int = 1
    """Nodes (the maximum of an elastic ``MIN:MAX``)."""

    rendezvous: bool = False
    """The arguments name a rendezvous of their own (``--nnodes`` > 1, ``--rdzv-endpoint``, ``--master-addr``,
    ``--standalone``): the launcher adds no ``--standalone``."""

    node_rank: int = 0

    @classmethod
    def parse(cls, args: list[str] | tuple[str, ...]) -> Torchrun:
        args = tuple(str(a) for a in args)
        if not args:
            return cls()  # the usual case: no need to import torch's parser (and torch) at all
        ns = _parse(args)
        if any(a.split("=")[0] in ("--nproc-per-node", "--nproc_per_node") for a in args):
            raise LaunchError("torchrun args: set the ranks per node with --nproc-per-node of autotune (or "
                              "world.nproc_per_node in the spec), not among the torchrun arguments")
        try:
            nnodes = int(str(ns.nnodes).split(":")[-1])
        except ValueError:
            raise LaunchError(f"torchrun args: --nnodes {ns.nnodes}: expected N or MIN:MAX") from None
        given = lambda name: getattr(ns, name) != _parser().get_default(name)
        own = nnodes > 1 or given("rdzv_endpoint") or given("master_addr") or bool(ns.standalone)
        return cls(args=args, nnodes=nnodes, rendezvous=own, node_rank=int(ns.node_rank or 0))

    def argv(self, nproc: int, program: list[str]) -> list[str]:
        """torchrun running ``program`` (``trainer_args``: the built-in job; ``script_args``: a user's script)."""
        # sys.executable: the run uses the same environment (venv) as the tuner.
        return [sys.executable, "-m", "torch.distributed.run", *([] if self.rendezvous else ["--standalone"]),
                "--nproc-per-node", str(nproc), *self.args, *program]

    def command(self, nproc: int, program: list[str]) -> str:
        """The command a user would type (``torchrun`` instead of the interpreter path)."""
        return " ".join(["torchrun", *([] if self.rendezvous else ["--standalone"]), "--nproc-per-node", str(nproc),
                         *self.args, *(shlex.quote(w) for w in program)])


def _parse(args: tuple[str, ...]):
    parser = _parser()
    try:
        ns, unknown = parser.parse_known_args([*args, "-m", "trainer"])
    except (SystemExit, argparse.ArgumentError):
        raise LaunchError(f"torchrun args {' '.join(args)}: torchrun does not accept them") from None
    if unknown:
        raise LaunchError(f"torchrun args: torchrun does not know {' '.join(unknown)}")
    return ns


@lru_cache(maxsize=1)
def _parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False  # a bad argument raises (and becomes a LaunchError) instead of exiting
    return parser


def merge_args(base: list[str], replace: dict[str, str]) -> list[str]:
    """``base`` torchrun arguments with every option named in ``replace`` (``nnodes``, ``rdzv_endpoint`` ...)
    replaced by the given value."""
    names = {k.replace("_", "-") for k in replace}
    out, i = [], 0
    while i < len(base):
        a = base[i]
        key = a.split("=", 1)[0].lstrip("-").replace("_", "-")
        takes_value = a.startswith("--") and "=" not in a and i + 1 < len(base) and not base[i + 1].startswith("--")
        width = 2 if takes_value else 1
        if key not in names:
            out.extend(base[i:i + width])
        i += width
    for k, v in replace.items():
        out.extend([f"--{k.replace('_', '-')}", str(v)])
    return out


def run_env(*, nccl: dict[str, str], nproc: int, gpus: list[str] | None, extra: dict[str, str] | None = None,
            cores: int | None = None, base: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment, the part the launcher set) for a run: its NCCL variables, threads per rank, the GPUs,
    and the safety variables always. Raises LaunchError for an unsafe NCCL/NVLS setting, set or inherited."""
    base = dict(os.environ if base is None else base)
    inherited = {k: v for k, v in base.items() if k.startswith("NCCL_") and k not in nccl}
    problems = [f"{p} (inherited from the environment)" for p in nccl_env_problems(inherited)]
    problems += nccl_env_problems(nccl)
    problems += nccl_env_problems({k: v for k, v in (extra or {}).items() if k.startswith("NCCL_")})
    for key in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        if key in base and base[key].strip() != "1":
            problems.append(f"{key}={base[key]} in the environment: NVLink multicast must stay off; unset it")
    if problems:
        raise LaunchError("unsafe environment for the run: " + "; ".join(problems))
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    ours = {**nccl, "OMP_NUM_THREADS": str(max(1, cores // max(1, nproc))), "PYTHONUNBUFFERED": "1",
            **(extra or {}), **SAFETY_ENV}
    if gpus is not None:
        ours["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return {**base, **ours}, ours


def trainer_args(config: Path, result: Path | None = None, *, cancel: Path | None = None,
                 serve: Path | None = None) -> list[str]:
    """``-m trainer`` and its arguments: the config, its result stream, the run's cancel file, a worker's requests
    (a user's training function, ``script.entry``, runs through the trainer too)."""
    return ["-m", "trainer", "--config", str(config), *(["--result", str(result)] if result else []),
            *(["--cancel", str(cancel)] if cancel else []), *(["--serve", str(serve)] if serve else [])]


def program(cfg: TrainConfig, config: Path, result: Path | None, *,
            cancel: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """(what torchrun runs for ``cfg``, the variables it needs): the built-in job or a user's training function
    through ``-m trainer``; a user's script file as itself, with its arguments and its run's request in a file
    beside the config (``trainer.runtime``: it reads ``AUTOTUNE_RUNTIME``)."""
    if not cfg.script.path:
        return trainer_args(config, result, cancel=cancel), {}
    request = Path(config).with_name("request.json")
    request.write_text(Request.from_config(cfg, result=str(result) if result else None,
                                           cancel=str(cancel) if cancel else None).to_json())
    return [cfg.script.path, *cfg.script.args], {ENV_REQUEST: str(request.resolve())}
