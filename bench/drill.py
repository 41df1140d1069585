"""A fault drill on this machine's real process group (NCCL on GPUs, gloo without): one tiny `autotune search` whose
trials are, in order, a healthy baseline, the last rank SIGKILLed mid-trial, the last rank hung mid-trial (its peers
inside the gradient all-reduce), and a healthy trial after them. Then checks what the search recorded and what it
left behind:

- each failure is a FAIL trial with its class (the kill: nccl or crash, noticed before the trial timeout; the hang:
  hang, at the trial timeout), and the trial after them completed with a figure and a finite loss;
- no process of any trial is alive (their process groups, `autotune.runner.process.processes_in`, and a scan of
  /proc for any process working in the drill's folder), and no trial recorded leftover pids;
- no process holds GPU memory and every GPU's used memory is back where it was before the drill (nvidia-smi;
  skipped, with a note, on a machine without GPUs).

    python3 bench/drill.py --out drill.json --work /tmp/state/drill [--data /tmp/jpegs] [--nproc N]

The failures are the tests' own (tests/helpers/models.py, aimed at the last rank by bench/drill_models.py). Exits 0
when every check passed. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.runner.process import proc_table, processes_in  # noqa: E402

M = "bench.drill_models:"
TINY = "tests.helpers.models:tiny"
STUDY = "drill"
# What each trial is, in the order the search runs them (trial 0 is the spec's baseline, 1-3 its starts).
ROLES = ("baseline", "kill", "hang", "after")


def spec(nproc: int | None, data: str | None, trial_timeout: float) -> dict:
    base_data = ({"kind": "imagefolder", "path": data, "decode": "pil", "image_size": 32} if data else
                 {"kind": "synthetic", "image_size": 32})
    return {
        "name": STUDY,
        "base": {
            "model": {"name": TINY},
            "data": {**base_data, "num_classes": None if data else 4},
            # Loader workers: the processes most likely to outlive a killed rank.
            "loader": {"num_workers": 2 if data else 0},
            "training": {"batch_size": 8},
            # Longer than the trial timeout: the watchdog, not NCCL's own timeout, must find the hang.
            "ddp": {"timeout_s": max(120, 3 * trial_timeout)},
            "measure": {"warmup_min_steps": 5, "window_s": 0.5, "precision": 0.05, "max_s": 2.0},
        },
        "world": {"nproc_per_node": nproc},
        "default_space": False,
        "space": {"model.name": {"choices": [TINY, M + "kill_last_rank", M + "hang_last_rank"]},
                  "training.batch_size": {"choices": [8, 16]}},
        "baseline": {"model.name": TINY, "training.batch_size": 8},
        "starts": [{"model.name": M + "kill_last_rank", "training.batch_size": 8},
                   {"model.name": M + "hang_last_rank", "training.batch_size": 8},
                   {"model.name": TINY, "training.batch_size": 16}],
        "budget": {"trials": len(ROLES), "trial_timeout_s": trial_timeout},
        "sampler": {"seed": 0},
        "pruner": {"kind": "none"},
        "stages": {"enabled": False},
    }


def gpu_memory() -> dict | None:
    """Used memory per GPU (MiB) and the processes holding GPU memory; None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None

    def query(what: str, fields: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    used = {int(i): int(m) for i, m in query("gpu", "index,memory.used")}
    apps = [{"pid": int(p), "used_mib": int(m) if m.isdigit() else m} for p, m in query("compute-apps",
                                                                                       "pid,used_memory")]
    return {"used_mib": used, "apps": apps}


def stray_processes(work: Path) -> list[dict]:
    """Live processes of the drill's search: every one runs in ``work`` (the search's working directory, which its
    torchrun, ranks and loader workers inherit) or names it on its command line. Another user's jobs on the same
    machine do neither."""
    found = []
    for pid, (_, _, state) in proc_table().items():
        if pid == os.getpid() or state == "Z":
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            line = " ".join(a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
        except OSError:  # gone, or another user's
            continue
        if cwd == str(work) or cwd.startswith(f"{work}/") or str(work) in line:
            found.append({"pid": pid, "cwd": cwd, "cmdline": line.strip()[:300]})
    return found


def log_tail(path: str | None, lines: int = 12) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-lines:] if path else []
    except OSError:
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="drill.json")
    p.add_argument("--work", required=True, help="a folder of its own for the study and the trials' logs (emptied)")
    p.add_argument("--data", help="an ImageFolder of JPEGs (then 2 loader workers per rank); default: synthetic")
    p.add_argument("--nproc", type=int, help="ranks (default: every visible GPU; 2 gloo ranks without GPUs)")
    p.add_argument("--trial-timeout", type=float, default=40.0, help="the hang is found after this (default 40 s)")
    args = p.parse_args()
    import optuna
    import yaml

    from autotune.study.storage import trial_attrs

    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = Path(args.data) / "train" if args.data and (Path(args.data) / "train").is_dir() else args.data
    spec_path = work / "drill.yaml"
    spec_path.write_text(yaml.safe_dump(spec(args.nproc, str(train) if train else None, args.trial_timeout),
                                        sort_keys=False))
    storage = f"sqlite:///{work / 'drill.db'}"
    gpu_before = gpu_memory()
    # The failures' factories live in this repository: the trials import them from its root.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    cmd = [sys.executable, "-m", "autotune", "search", "--spec", str(spec_path), "--storage", storage,
           "--study", STUDY, "--trials", str(len(ROLES))]
    if args.nproc:
        cmd += ["--nproc-per-node", str(args.nproc)]
    t0 = time.time()
    print("drill: " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                          timeout=len(ROLES) * (args.trial_timeout + 60) + 120)
    wall = time.time() - t0
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("autotune") or (line.lstrip().startswith("trial ") and not any(
                w in line for w in (" window ", " warm-up", " measuring"))):
            print("  " + line, flush=True)

    # What the machine looks like once the search is gone: give the driver a few seconds to release memory.
    gpu_after = gpu_memory()
    for _ in range(20):
        if gpu_after is None or not gpu_after["apps"]:
            break
        time.sleep(0.5)
        gpu_after = gpu_memory()
    strays = stray_processes(work)

    trials = optuna.load_study(study_name=STUDY, storage=storage).get_trials()
    rows, pgids = [], set()
    for t in trials:
        a = trial_attrs(t)
        pgids |= set(a.get("pgids") or [])
        rows.append({"trial": t.number, "role": ROLES[t.number] if t.number < len(ROLES) else "extra",
                     "model": t.params.get("model.name"), "state": t.state.name,
                     "failure_class": a.get("failure_class"), "failure_message": (a.get("failure_message") or "")[:300],
                     "imgs_per_s": a.get("imgs_per_s"), "loss_start": a.get("loss_start"),
                     "loss_end": a.get("loss_end"),
                     "wall_s": a.get("wall_s"), "windows": a.get("windows"), "worker": a.get("worker"),
                     "pgids": a.get("pgids"), "leftover_pids": a.get("leftover_pids"),
                     "alive_in_its_groups": processes_in(set(a.get("pgids") or [])),
                     "log_path": a.get("log_path"),
                     "log_tail": log_tail(a.get("log_path")) if a.get("failure_class") else []})
    by = {r["role"]: r for r in rows}
    checks: dict[str, dict] = {}

    def check(name: str, ok: bool, detail) -> None:
        checks[name] = {"ok": bool(ok), "detail": detail}

    kill, hang, after = by.get("kill") or {}, by.get("hang") or {}, by.get("after") or {}
    check("kill: FAIL with class nccl or crash, before the trial timeout",
          kill.get("state") == "FAIL" and kill.get("failure_class") in ("nccl", "crash")
          and (kill.get("wall_s") or 1e9) < args.trial_timeout,
          {k: kill.get(k) for k in ("state", "failure_class", "wall_s", "failure_message")})
    check("hang: FAIL with class hang, at the trial timeout",
          hang.get("state") == "FAIL" and hang.get("failure_class") == "hang"
          and (hang.get("wall_s") or 0) >= args.trial_timeout,
          {k: hang.get(k) for k in ("state", "failure_class", "wall_s", "failure_message")})
    check("the trial after them completed with a figure and a loss",
          after.get("state") == "COMPLETE" and not after.get("failure_class") and (after.get("imgs_per_s") or 0) > 0
          and after.get("loss_end") is not None,
          {k: after.get(k) for k in ("state", "failure_class", "imgs_per_s", "loss_start", "loss_end", "worker")})
    check("baseline completed", (by.get("baseline") or {}).get("state") == "COMPLETE",
          {k: (by.get("baseline") or {}).get(k) for k in ("state", "imgs_per_s", "failure_class")})
    check("no process left in any trial's process groups, none recorded as left over",
          not processes_in(pgids) and not any(r["leftover_pids"] for r in rows),
          {"groups": sorted(pgids), "alive": processes_in(pgids),
           "leftover_pids": {r["trial"]: r["leftover_pids"] for r in rows if r["leftover_pids"]}})
    check("no process of the drill's search left on the machine (by working directory)", not strays, strays)
    if gpu_before is None:
        gpu = {"skipped": "no nvidia-smi on this machine (DRY=1 or a CPU machine): GPU memory not checked"}
    else:
        grown = {i: gpu_after["used_mib"].get(i, 0) - m for i, m in gpu_before["used_mib"].items()}
        gpu = {"before": gpu_before, "after": gpu_after, "grown_mib": grown}
        # A GPU's used memory is back within 64 MiB (the driver's own bookkeeping moves by a few MiB).
        check("no process holds GPU memory, every GPU's used memory back where it was",
              not gpu_after["apps"] and all(g <= 64 for g in grown.values()), gpu)
    ok = proc.returncode in (0, 1) and all(c["ok"] for c in checks.values())
    result = {"ok": ok, "search_returncode": proc.returncode, "search_wall_s": round(wall, 1),
              "trial_timeout_s": args.trial_timeout, "nproc": args.nproc, "data": str(train) if train else None,
              "checks": checks, "trials": rows, "gpu": gpu,
              "search_output_tail": (proc.stdout + proc.stderr).splitlines()[-40:]}
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    print(f"\n{'trial':<6}{'role':<10}{'state':<10}{'class':<8}{'wall s':>8}{'imgs/s':>10}  message")
    for r in rows:
        ips = f"{r['imgs_per_s']:,.0f}" if r["imgs_per_s"] else "n/a"
        wall_s = f"{r['wall_s']:.1f}" if r["wall_s"] is not None else "n/a"
        print(f"{r['trial']:<6}{r['role']:<10}{r['state']:<10}{r['failure_class'] or '-':<8}{wall_s:>8}{ips:>10}  "
              f"{r['failure_message'][:90]}")
    for name, c in checks.items():
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {name}")
    if "skipped" in gpu:
        print(f"note  {gpu['skipped']}")
    print(f"drill: {'every check passed' if ok else 'FAILED'} (search exit {proc.returncode}, {wall:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
