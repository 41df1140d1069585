"""Full runs: an exported config (``autotune export best.yaml``) → ``torchrun -m trainer`` in train mode.

The job is the one every search trial ran, in ``train`` mode: epochs over the dataset with DistributedSampler,
warm-up + cosine LR, validation each epoch, atomic checkpoints, exact resume. This module prepares the run (the
config's world size, torchrun arguments and environment from the export's ``autotune:`` section, the NVLink-multicast
safety variables always), launches it in a process group of its own, turns the job's JSON-lines stream into a
progress bar, and at the end sets the measured imgs/s and NVML utilization against the figures the search measured
for the same config: a full run that is clearly slower than its trial means something differs (another host, a busy
file system, a different world size) and the user should know.

Ctrl-C (or SIGTERM/SIGHUP to this process) kills the whole job — torchrun, its ranks and their loader workers — and
says how to resume.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from autotune.exceptions import AutotuneError, LaunchError, Terminated
from autotune.formatting import fmt_duration, fmt_interval, fmt_ips, per_second, plural
from autotune.hw.nvml import Nvml, Sampler, summarize
from autotune.hw.placement import gpu_count, place, to_nvml, visible_entries
from autotune.runner.process import LineReader, ProcessTree
from autotune.runner.torchrun import Torchrun, merge_args, program, run_env
from autotune.runner.trial import TrialRun, follow, steady_windows
from autotune.space import uninstalled
from autotune.verdict import FIXES, OK, Verdict, ending
from trainer.config import TrainConfig, load_yaml_mapping
from trainer.protocol import Failure, Kind, nccl_env_problems
from trainer.runtime.request import ENV_CONFIG, ENV_REQUEST

SLOWER_WARNING = 0.05
"""Warn when the run's median imgs/s is more than this fraction below the search's figure for the config."""

NVML_INTERVAL_S = 1.0
"""A full run lasts hours: 1 Hz keeps the sampler's memory small and is plenty for a run-long mean."""

TORCHRUN_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend", "rdzv_conf", "master_addr",
                  "master_port", "max_restarts")
"""torchrun options ``autotune train`` passes through (multi-node runs); spelled with dashes on the command line."""


class TrainError(AutotuneError):
    """The full run could not start, or the job failed."""


@dataclass(kw_only=True)
class TrainOptions:
    config: Path
    """An exported YAML (``autotune export``) or any TrainConfig YAML."""

    epochs: int | None = None
    """Epochs to train; default: the config's ``training.epochs``."""

    resume: bool = False
    """Continue from the newest checkpoint in the run's checkpoint folder."""

    out: Path | None = None
    """Run folder (checkpoints, logs, result stream); default: the config's ``output_dir``."""

    nproc_per_node: int | None = None
    """Ranks per node; default: the export's ``autotune.torchrun.nproc_per_node`` (the searched world size)."""

    torchrun_args: dict[str, str] = field(default_factory=dict)
    """Pass-through torchrun options by name (``nnodes``, ``rdzv_endpoint``, ...); they replace the export's."""

    gpus: list[str] | None = None
    """GPUs to use, indices into ``CUDA_VISIBLE_DEVICES`` or UUIDs; default: the first ``nproc_per_node`` visible."""

    overrides: dict[str, Any] = field(default_factory=dict)
    """Further settings by dotted path (``--set data.val_fraction=0.05``)."""

    script_args: list[str] | None = None
    """A user's script's own arguments for this run (``autotune train --config best.yaml -- --epochs 90``); None:
    the export's."""


@dataclass(kw_only=True)
class TrainPlan:
    """Everything decided before launch."""

    config: Any
    """The TrainConfig the job runs (train mode, epochs, resume, output_dir applied)."""

    export: dict[str, Any]
    """The ``autotune:`` section of the YAML (empty for a hand-written config)."""

    out: Path
    config_path: Path
    result_path: Path
    log_path: Path
    nproc: int
    nnodes: int
    torchrun_args: list[str]
    gpu_entries: list[str] | None
    """CUDA_VISIBLE_DEVICES entries of this node's ranks; ``None`` on a machine without GPUs."""

    extra_env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    comparable: bool = True
    """Whether the search's figures were measured at this world size (otherwise no comparison is made)."""

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The run's environment: the export's variables, threads per rank, the GPUs, the safety variables (and, for
        a user's script, where its run's request is)."""
        return {**run_env(nccl=self.config.nccl.to_env(), nproc=self.nproc, gpus=self.gpu_entries,
                          extra=self.extra_env, base=base)[0], **self._program()[1]}

    def argv(self) -> list[str]:
        return Torchrun.parse(self.torchrun_args).argv(self.nproc, self._program()[0])

    def _program(self) -> tuple[list[str], dict[str, str]]:
        return program(self.config, self.config_path, self.result_path)


# ---- planning ------------------------------------------------------------------------------------------------------


def load_config(path: Path) -> tuple[TrainConfig, dict[str, Any]]:
    """(TrainConfig, the export's ``autotune:`` section or {})."""
    data = load_yaml_mapping(path)
    section = data.get("autotune") or {}
    if not isinstance(section, dict):
        raise TrainError(f"{path}: the autotune: section must be a mapping; re-export with `autotune export`")
    return TrainConfig.from_dict(data), section


def plan(o: TrainOptions, *, nvml: Nvml | None = None) -> TrainPlan:
    """Everything decided before launch: the config in train mode, the world, the GPUs, the environment."""
    cfg, section = load_config(Path(o.config))
    tr = section.get("torchrun") or {}
    notes: list[str] = []
    searched_nproc = tr.get("nproc_per_node")
    export_args = [str(a) for a in tr.get("args") or []]
    torchrun_args = merge_args(export_args, o.torchrun_args)
    torchrun = Torchrun.parse(torchrun_args)
    nproc, entries = _placement(o, o.nproc_per_node or searched_nproc, nvml or Nvml(), notes)
    searched_world = (searched_nproc or 0) * Torchrun.parse(export_args).nnodes
    comparable = bool(section.get("measured")) and searched_world == nproc * torchrun.nnodes
    if section.get("measured") and not comparable:
        notes.append(f"the search measured a world of {searched_world} rank(s), this run has "
                     f"{nproc * torchrun.nnodes}: its figures are not comparable (and the learning rate was scaled "
                     "for the searched global batch)")
    cfg, out = _train_config(o, cfg)
    missing = uninstalled(cfg.to_dict())
    if missing:
        raise TrainError(f"{o.config}: " + "; ".join(missing))
    ckpts = sorted(cfg.checkpoint_dir.glob("ckpt-*.pt")) if cfg.checkpoint_dir.is_dir() else []
    if ckpts and not o.resume:
        raise TrainError(f"{cfg.checkpoint_dir} holds checkpoints of an earlier run (newest {ckpts[-1].name}): "
                         "pass --resume to continue it, or --out NEW_DIR for a fresh run")
    notes += _notes(o, cfg, torchrun, has_checkpoints=bool(ckpts))
    # (an older export carried the search trial's own request file: a run makes its own)
    env = {str(k): str(v) for k, v in (section.get("env") or {}).items() if k not in (ENV_REQUEST, ENV_CONFIG)}
    # The search host's GPU list means nothing here; thread counts are per rank, so only valid at that world size.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if nproc != searched_nproc:
        env.pop("OMP_NUM_THREADS", None)
    problems = nccl_env_problems({k: v for k, v in env.items() if k.startswith("NCCL_")})
    if problems:
        raise LaunchError(f"{o.config}: autotune.env: " + "; ".join(problems))
    return TrainPlan(config=cfg, export=section, out=out, config_path=out / "train.yaml",
                     result_path=out / "result.jsonl", log_path=out / "train.log", nproc=nproc,
                     nnodes=torchrun.nnodes, torchrun_args=torchrun_args, gpu_entries=entries or None, extra_env=env,
                     notes=notes, comparable=comparable)


def _placement(o: TrainOptions, nproc: int | None, nvml: Nvml, notes: list[str]) -> tuple[int, list[str] | None]:
    """(ranks per node, this host's GPU entries): this host's GPUs, whatever the search host had;
    CUDA_VISIBLE_DEVICES pinned to UUIDs as a trial's is."""
    count = gpu_count(nvml)
    visible = visible_entries(count) if count else []  # CUDA_VISIBLE_DEVICES=0 on a CPU host is no GPU
    if nproc is None:
        notes.append(f"{o.config} records no world size (not an export?): every GPU selected, or 2 gloo ranks")
    nproc, entries = place(visible, o.gpus, nproc)
    if not entries:
        return nproc, entries
    gpus = to_nvml(nvml, entries)
    return nproc, [g.uuid if g.index >= 0 else e for g, e in zip(gpus, entries, strict=True)] if gpus else entries


def _train_config(o: TrainOptions, cfg: TrainConfig) -> tuple[TrainConfig, Path]:
    """The config in train mode with the run's epochs, folder and ``--set`` overrides; and the folder."""
    t = cfg.training
    overrides: dict[str, Any] = {"training.mode": "train", "checkpoint.resume": bool(o.resume)}
    if cfg.script.given:  # the script counts its own epochs, keeps its own checkpoints and resumes itself
        if o.epochs is not None or o.resume:
            flag = "--epochs" if o.epochs is not None else "--resume"
            raise TrainError(f"{flag}: {cfg.script.path or cfg.script.entry} counts its own epochs and keeps its "
                             "own checkpoints; pass its arguments after `--` (autotune train --config "
                             f"{o.config} -- --epochs 90)")
        out = Path(o.out if o.out is not None else cfg.output_dir).expanduser().resolve()
        overrides = {"training.mode": "train", "output_dir": str(out), **o.overrides}
        if o.script_args is not None:
            overrides["script.args"] = list(o.script_args)
        return cfg.with_overrides(overrides), out
    if o.script_args:
        raise TrainError(f"arguments after `--` ({' '.join(o.script_args)}) are a script's: {o.config} runs the "
                         "built-in job")
    if o.epochs is not None:
        if o.epochs < 1:
            raise TrainError(f"--epochs {o.epochs}: must be >= 1")
        overrides.update({"training.epochs": o.epochs, "training.steps": None})
    elif t.epochs is None and t.steps is None:
        raise TrainError(f"{o.config} sets no training.epochs: pass --epochs N")
    out = Path(o.out if o.out is not None else cfg.output_dir).expanduser().resolve()
    overrides["output_dir"] = str(out)
    overrides.update(o.overrides)
    return cfg.with_overrides(overrides), out


def _notes(o: TrainOptions, cfg: TrainConfig, torchrun: Torchrun, *, has_checkpoints: bool) -> list[str]:
    notes = []
    if torchrun.nnodes > 1 and torchrun.node_rank != 0:
        notes.append(f"node rank {torchrun.node_rank}: rank 0 runs on another node, so progress, validation and the "
                     "figures are shown there; this node shows only its own errors")
    if torchrun.nnodes > 1 and o.resume:
        notes.append("multi-node --resume: every node reads the checkpoint rank 0 wrote, so --out must be on a file "
                     "system all nodes share")
    if o.resume and not has_checkpoints:
        notes.append(f"--resume: no checkpoint in {cfg.checkpoint_dir} yet; starting from the beginning")
    if cfg.training.validate_every and cfg.data.kind == "imagefolder" and not _has_validation(cfg):
        notes.append("no validation data (no val/ folder next to train/, data.val_fraction 0): no top-1/top-5; "
                     "`--set data.val_fraction=0.05` holds out 5 % of the training images")
    return notes


def _has_validation(cfg) -> bool:
    d = cfg.data
    if d.val_path or d.val_fraction > 0:
        return True
    return bool(d.path) and (Path(d.path) / "val").is_dir()


# ---- running -------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainResult:
    returncode: int
    records: list[dict] = field(default_factory=list)
    summary: dict | None = None
    vals: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    gpu: dict[str, Any] = field(default_factory=dict)
    """``autotune.hw.nvml.summarize`` of the run's windows (``util_available`` False without NVML)."""

    wall_s: float = 0.0
    leftover_pids: list[int] = field(default_factory=list)
    verdict: Verdict = OK
    """How the job ended (``autotune.verdict.ending``): its failure's class and reason, when it failed."""

    @classmethod
    def of(cls, records: list[dict], **kw) -> TrainResult:
        by = lambda kind: [r for r in records if r.get("kind") == kind]
        summaries = by(Kind.SUMMARY)
        return cls(records=records, summary=summaries[-1] if summaries else None, vals=by(Kind.VAL),
                   checkpoints=by(Kind.CHECKPOINT), errors=by(Kind.ERROR), **kw)


def run(p: TrainPlan, *, out: TextIO = sys.stdout, progress: bool | None = None,
        nvml: Nvml | None = None) -> TrainResult:
    """Launch the job, stream it, and clean up; KeyboardInterrupt (and SIGTERM/SIGHUP) kills the whole job."""
    p.out.mkdir(parents=True, exist_ok=True)
    p.config.to_yaml(p.config_path)
    env, argv = p.env(), p.argv()
    nvml = nvml if nvml is not None else Nvml()
    gpus = to_nvml(nvml, p.gpu_entries) if p.gpu_entries and nvml.available else []
    sampler = Sampler(nvml, gpus, interval=NVML_INTERVAL_S)
    reader = LineReader(p.result_path, pos=_append_point(p.result_path))
    view = ProgressView(out=out, enabled=out.isatty() if progress is None else progress)
    followed = TrialRun(log_path=p.log_path, result_path=p.result_path)
    t0 = time.monotonic()
    with open(p.log_path, "ab") as log:
        log.write(("\n$ " + " ".join(argv) + "\n").encode())
        log.flush()
        # A user's script prints its own progress: shown as it prints it, and kept in the log.
        echo = Echo(p.log_path, log.tell(), view.say) if p.config.script.given else None
        # Only the main thread may install handlers (the CLI runs there; an embedding caller keeps its own).
        old = ({s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
               if threading.current_thread() is threading.main_thread() else {})
        tree = None
        try:
            sampler.start()
            tree = ProcessTree(argv, env=env, log=log)
            follow(tree, reader, followed, timeout_s=None, on_record=view.record, on_poll=echo)
            leftover = tree.finish() if tree.poll() is not None else tree.kill()
        except KeyboardInterrupt:
            view.close()
            if tree is not None:
                left = tree.kill()
                stuck = f" ({len(left)} processes would not die: {left})" if left else ""
                again = ("run it again as it was run (the script resumes from its own checkpoints, if it keeps any)"
                         if p.config.script.given else f"continue it with `autotune train --config {p.config_path} "
                         f"--resume` (checkpoints in {p.config.checkpoint_dir})")
                print(f"autotune train: interrupted: job killed{stuck}; {again}", file=sys.stderr, flush=True)
            raise
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            sampler.stop()
    if echo is not None:
        echo(final=True)
    for rec in reader.read(final=True):
        followed.records.append(rec)
        view.record(rec)
    view.close()
    followed.returncode, followed.t_end = tree.returncode, time.time()
    result = TrainResult.of(followed.records, returncode=tree.returncode, leftover_pids=leftover,
                            wall_s=time.monotonic() - t0, verdict=ending(followed))
    windows = steady_windows(followed.windows, result.summary)
    result.gpu = summarize(sampler.samples, windows, len(gpus)) if gpus else \
        {"util_available": False, "reason": "no GPU" if not p.gpu_entries else (nvml.reason or "no NVML device")}
    return result


def _append_point(path: Path) -> int:
    """Where a resumed run's records start: it appends to the killed run's stream, and only what is new is read."""
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")  # a line torn by the kill must not swallow the new run's first record
    return path.stat().st_size


def _raise_interrupted(signum, frame):
    raise Terminated(signum)


class Echo:
    """A log's new lines, from ``pos`` on, handed to ``say`` each time it is called (a line still being written
    waits for its end, unless ``final``)."""

    def __init__(self, path: Path, pos: int, say: Callable[[str], None]):
        self.path, self.pos, self.say, self.rest = path, pos, say, b""

    def __call__(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except OSError:
            return
        self.pos += len(chunk)
        lines = (self.rest + chunk).split(b"\n")
        self.rest = b"" if final else lines.pop()
        for line in lines:
            text = line.decode(errors="replace").rstrip("\r")
            if text or not final:
                self.say(f"| {text}")


class ProgressView:
    """The job's records on the terminal: a tqdm bar (steps, imgs/s, loss, ETA) on a TTY, plain lines otherwise;
    validation results and checkpoints always get a line of their own."""

    def __init__(self, *, out: TextIO, enabled: bool):
        self.out, self.enabled, self.bar = out, enabled, None
        self.rate: float | None = None
        self.per = "imgs/s"
        """The rate's label: a user's script says its unit in its settings record."""

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def _ensure_bar(self, total: int | None, step: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, initial=step, unit="step", file=self.out, dynamic_ncols=True,
                            smoothing=0.1, desc="train")
        elif total and self.bar.total != total:
            self.bar.total = total

    def record(self, rec: dict) -> None:
        kind = rec.get("kind")
        if kind == "window" and rec.get("imgs_per_s") is not None:
            self.rate = float(rec["imgs_per_s"])
        elif kind == "settings":
            self.per = per_second(rec.get("unit"))
        elif kind == "start":
            self.say(f"job started: {rec.get('world_size')} rank(s), {rec.get('backend')} on {rec.get('device')}"
                      + (f" ({rec['gpu']})" if rec.get("gpu") else ""))
        elif kind == "resume":
            self.say(f"resumed from {rec.get('path')} (epoch {rec.get('epoch')}, step {rec.get('step')})")
            self._ensure_bar(None, int(rec.get("step", 0)))
        elif kind in ("progress", "epoch"):
            step = int(rec.get("step", 0))
            self._ensure_bar(rec.get("total_steps"), step)
            if kind == "progress" and rec.get("imgs_per_s") is not None:
                self.rate = float(rec["imgs_per_s"])
            if self.bar is not None:
                self.bar.update(max(0, step - self.bar.n))
                post = {"epoch": rec["epoch"]} if rec.get("epoch") is not None else {}
                if rec.get("loss") is not None:
                    post["loss"] = f"{float(rec['loss']):.4f}"
                if self.rate is not None:
                    post[self.per] = f"{self.rate:,.0f}"
                self.bar.set_postfix(post, refresh=True)
            elif kind == "progress":
                self.say(self._progress_line(rec, step))
        elif kind == "val":
            self.say(f"epoch {rec.get('epoch')}: val top1 {float(rec['top1']):.4f} top5 {float(rec['top5']):.4f} "
                      f"loss {float(rec['loss']):.4f} ({rec.get('images')} images)")
        elif kind == "checkpoint":
            self.say(f"checkpoint: {rec.get('path')} (epoch {rec.get('epoch')}, step {rec.get('step')})")
        elif kind == "error":
            self.say(f"error on rank {rec.get('rank')} ({rec.get('class')}): {rec.get('message')}")

    def _progress_line(self, rec: dict, step: int) -> str:
        """``step 8/32 epoch 1 loss 0.5000 120.0 imgs/s``, saying only what the run knows (a user's script that
        loops without ``run.epochs`` has no epoch and no total)."""
        total, epoch, loss = rec.get("total_steps"), rec.get("epoch"), rec.get("loss")
        parts = [f"step {step}" + (f"/{total}" if total is not None else "")]
        if epoch is not None:
            parts.append(f"epoch {epoch}")
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        parts.append(f"{fmt_ips(self.rate)} {self.per}" if self.rate else "warming up")
        return " ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ---- the closing lines ---------------------------------------------------------------------------------------------


def closing_lines(p: TrainPlan, r: TrainResult) -> tuple[list[str], list[str], dict[str, Any]]:
    """What a finished run says: (lines, warnings, a JSON-able summary) comparing the run with the search's figures."""
    lines: list[str] = []
    warnings: list[str] = []
    s = r.summary or {}
    ips = s.get("imgs_per_s")
    per = per_second(s.get("unit"))
    last_val = r.vals[-1] if r.vals else None
    m = p.export.get("measured") or {}
    # A user's script that loops without ``run.epochs`` reports steps only.
    epochs = f"{s.get('epochs', '?')} epoch(s), " if s.get("epochs") or p.config.data.kind != "script" else ""
    script = p.config.script.given
    # A script keeps its own checkpoints (if any) and runs its own validation: the runtime writes neither.
    kept = (f"; checkpoints in {p.config.checkpoint_dir}" if not script or r.checkpoints else "")
    lines.append(f"done in {fmt_duration(r.wall_s)}: {epochs}{s.get('steps', '?')} steps"
                 + (f"; final val top1 {last_val['top1']:.4f} top5 {last_val['top5']:.4f} (epoch {last_val['epoch']})"
                    if last_val else "; no validation" if not script else "") + kept)
    if ips is None:
        lines.append("measured: no timed window closed (the run was too short to measure throughput)")
    elif s.get("ci_half_width") is None:
        lines.append(f"measured: {fmt_ips(ips)} {per} ({plural(s.get('windows') or 0, 'window')}: too few for an "
                     "interval; a longer run measures more)")
    else:
        half = s.get("ci_half_width")
        lines.append(f"measured: {fmt_interval(ips, half, per)} (95 % interval, the whole run's samples over its "
                     f"slowest rank's seconds, {s.get('windows')} windows)")
        target = p.config.measure.precision
        if half is not None and half > target:
            warnings.append(f"the run's interval is ± {half:.1%}, wider than measure.precision ({target:.0%}): "
                            f"its pace changed along the way (epoch starts, another load on the machine), so its "
                            f"figure is less certain; each window's {per} is in {p.result_path}")
    lines.append(f"loss: {loss_line(s)}")
    g = r.gpu
    if g.get("util_available"):
        lines.append(f"GPU: NVML utilization {g['util_mean']:.0f} % (p50 per GPU: {g.get('util_p50_per_gpu')}), "
                     f"power {g.get('power_mean_w')} W, memory max {g.get('mem_used_max_mib')} MiB")
    else:
        lines.append(f"GPU: NVML utilization unavailable ({g.get('reason') or 'no sample inside a timed window'})")
    ratio = _compare(p, ips, per, lines, warnings)
    summary = {"imgs_per_s": ips, "ci_half_width": s.get("ci_half_width"), "windows": s.get("windows"),
               "epochs": s.get("epochs"),
               "loss_start": s.get("loss_start"), "loss_end": s.get("loss_end"), "loss": s.get("loss"),
               "loss_finite": s.get("loss_finite"),
               "steps": s.get("steps"), "val": last_val, "gpu": g, "searched": m or None, "ratio": ratio,
               "comparable": p.comparable, "wall_s": round(r.wall_s, 3), "returncode": r.returncode,
               "checkpoints": [c.get("path") for c in r.checkpoints]}
    return lines, warnings, summary


def _compare(p: TrainPlan, ips: float | None, per: str, lines: list[str], warnings: list[str]) -> float | None:
    """This run against the export's figure: its fresh-process re-measure when it has one (the figure the export
    said to trust: the search's may have profited from a warm worker), else the search's, each with its interval.
    Returns the ratio."""
    m = p.export.get("measured") or {}
    again = m.get("remeasured") or {}
    if not m.get("imgs_per_s") or ips is None:
        return None
    src = f"study {p.export.get('study')}, trial {p.export.get('trial')}"
    if again.get("imgs_per_s"):
        ref, half, what = float(again["imgs_per_s"]), again.get("ci_half_width"), \
            "the export's re-measure in a fresh process"
        name = (f"re-measure ({src}, in a fresh process; the search measured "
                f"{fmt_interval(float(m['imgs_per_s']), m.get('ci_half_width'))})")
    else:
        ref, half, what = float(m["imgs_per_s"]), m.get("ci_half_width"), "the search measured"
        util = f", util {m['util_mean']:.0f} %" if m.get("util_mean") is not None else ""
        name = f"search ({src}{util})"
    if not p.comparable:
        lines.append(f"{name}: {fmt_interval(ref, half, per)} at another world size: not compared")
        return None
    ratio = ips / ref
    lines.append(f"{name}: {fmt_interval(ref, half, per)} -> this run: {ratio:.1%} of it")
    if ratio < 1 - SLOWER_WARNING:
        warnings.append(f"this run is {1 - ratio:.1%} slower than {what} for the same config ({fmt_ips(ips)} vs "
                        f"{fmt_ips(ref)} {per}): check that the host, GPUs, data location and concurrent load match "
                        f"the search's (`autotune show`); each window's {per} is in {p.result_path}")
    return ratio


def loss_line(s: dict[str, Any]) -> str:
    """The training loss over the run's windows and at its end: a full run that does not learn is not done."""
    if s.get("loss_finite") is False:
        return f"not finite (NaN/inf): the run diverged; {FIXES[Failure.DIVERGED]}"
    start, end, last = s.get("loss_start"), s.get("loss_end"), s.get("loss")
    if start is None and end is None and last is None:
        return "not recorded"
    span = f"{start:.4g} -> {end:.4g} over the timed windows" if start is not None and end is not None else ""
    return ", ".join(x for x in (span, f"{last:.4g} at the last step" if last is not None else "") if x)


def failure_message(p: TrainPlan, r: TrainResult) -> str:
    """Why the job failed, in one line (``r.verdict``): the root cause's rank and message, or what its log shows."""
    v, e = r.verdict, r.verdict.error
    if e is not None:
        return f"the job failed ({v.failure}, rank {e.get('rank')}): {e.get('message')}; log: {p.log_path}"
    shows = f" ({v.failure}: {v.reason})" if v.failure is not None else ""
    return f"the job exited with code {r.returncode} and no error record{shows}; log: {p.log_path}"


def write_summary(p: TrainPlan, summary: dict[str, Any]) -> Path:
    path = p.out / "train-summary.json"
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return path


def _script_value(cfg: TrainConfig, name: str):
    from trainer.knobs import table

    node = cfg.to_dict()
    for part in table().by_runtime_name[name].path.split("."):
        node = node[part]
    return round(node, 3) if isinstance(node, float) else node


def describe(p: TrainPlan) -> str:
    where = (f"{p.nproc} GPU(s) per node ({', '.join(e[:12] for e in p.gpu_entries)})" if p.gpu_entries
             else f"{p.nproc} gloo rank(s) on the CPU")
    t = p.config.training
    nodes = f" x {p.nnodes} nodes" if p.nnodes > 1 else ""
    s = p.config.script
    if s.given:  # the script decides its epochs, optimizer and schedule: say what the run hands it
        tuned = ", ".join(f"{n}={_script_value(p.config, n)}" for n in s.applies) or "nothing"
        return (f"autotune train: {p.config.name}: {s.path or s.entry} {' '.join(s.args)} on {where}{nodes} with "
                f"{tuned}; run folder {p.out} (log: {p.log_path.name})")
    length = f"{t.epochs} epoch(s)" if t.steps is None else f"{t.steps} steps"
    return (f"autotune train: {p.config.name}: {length} on {where}{nodes}, {t.precision}, batch {t.batch_size}"
            f"{f' x {t.accum_steps} accum' if t.accum_steps > 1 else ''}, lr {p.config.optimizer.lr:g} "
            f"({p.config.optimizer.schedule}); run folder {p.out} (log: {p.log_path.name})")

