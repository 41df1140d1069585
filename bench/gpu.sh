#!/usr/bin/env bash
# All GPU work of one session, in one call on nvidia-h200-x2 (see ../shared/GPU.md). Usage, from the repo root on the
# GPU machine, after the wheel install line:  bash bench/gpu.sh STAGE [RUN ...]
# Stages: job (default), pipeline, search N, final, or run names of bench/run.py.
# Writes JSON and logs under $OUT (default bench/out) and prints a table last.
# Wheels: `../shared/gpu-wheels.sh .whl nvidia-nvimgcodec-cu13 nvidia-nvjpeg` (the nvjpeg-hw decode path needs the
# last two; ~29 MB more, inside the 64 MiB a call carries).
# Chain calls within the machine's 30 s warm period and /tmp (JPEGs, the study in /tmp/state) carries over; a study
# also resumes on a fresh machine from bench/state/$STUDY.db when that is carried.
set -uo pipefail
out=${OUT:-bench/out}; mkdir -p "$out"
stage=${1:-job}; shift || true
# torchrun's per-rank banners and warnings, kept in the logs under $OUT, not on the screen.
quiet() { grep -v "^W1\|^\*\*\*\|OMP_NUM_THREADS"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
data=${DATA:-/tmp/jpegs}; study=${STUDY:-resnet50}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv,noheader
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'gpus', torch.cuda.device_count(), 'cpus', __import__('os').cpu_count())"
# 32,000 ImageNet-like JPEGs (100 class folders; the model head keeps 1000 classes, as for ImageNet).
python3 -m autotune make-data "$data" --images "${IMAGES:-32000}" --classes 100 --no-progress 2>&1 | tail -1
case "$stage" in
  job) runs=${*:-seed-default strong-pil strong-tvcpu strong-synthetic bare-synthetic loader-pil loader-tvcpu loader-nvjpeg strong-nvjpeg-bf16 strong-nvjpeg-fp16} ;;
  pipeline)
    # One GPU: stage costs (wall and GPU ms), and a ResNet-50 loop fed by each pipeline in one process.
    timeout 150 python3 bench/pipeline_gpu.py "$data" --out "$out/pipeline_gpu.json" --workers 6 --hybrid 0.25,0.5 \
      --train --seconds 3 2>&1 | tail -24
    runs=${*:-strong-hybrid-fp16-50 strong-nvjpeg-fp16} ;;
  search)
    # A real search of the default GPU study on the same JPEGs. The study lives in /tmp/state while the machine stays
    # warm; bench/state/$study.db (git-ignored; carry it) seeds it on a fresh machine, so the study resumes.
    # SEARCH_TIMEOUT: start no trial after this many seconds (a trial runs to its end: no trial is cut short).
    mkdir -p /tmp/state; db="sqlite:////tmp/state/$study.db"
    [ -f /tmp/state/$study.db ] || [ ! -f bench/state/$study.db ] || cp bench/state/$study.db /tmp/state/
    python3 -m autotune search --trials "${1:-4}" --timeout "${SEARCH_TIMEOUT:-200}" --data "$data" --storage "$db" \
      2>&1 | tee -a "$out/search.log" | quiet
    python3 -m autotune show --study "$study" --storage "$db" 2>&1 | tee "$out/search-table.txt"
    cp /tmp/state/$study.db "$out/"
    tar czf "$out/search-trials.tgz" -C /tmp/state "$study"
    exit 0 ;;
  final)
    # The search's best config: exported, re-measured 3 times as the search measured it, then a short full run
    # (`autotune train`) on a 4x larger view of the same JPEGs (hard links, so an epoch lasts ~4x a trial's windows),
    # interrupted once after its first checkpoint and resumed.
    db="sqlite:////tmp/state/$study.db"
    [ -f /tmp/state/$study.db ] || { mkdir -p /tmp/state; cp bench/state/$study.db /tmp/state/; }
    python3 -m autotune export "$out/best.yaml" --study "$study" --storage "$db" || exit 1
    python3 bench/run.py --config "$out/best.yaml" --repeat 3 --out "$out/remeasure.json" --trials-dir /tmp/remeasure \
      --timeout 150 2>&1 | tee "$out/remeasure.log" | quiet
    # Side by side on this machine: the seed's defaults, and the best config fed synthetic data (its ceiling).
    python3 bench/run.py seed-default --data "$data" --out "$out/compare-seed.json" --trials-dir /tmp/remeasure \
      --timeout 150 2>&1 | tee -a "$out/remeasure.log" | quiet
    python3 bench/run.py --config "$out/best.yaml" --repeat 1 --label best-synthetic --set data.kind=synthetic \
      --out "$out/compare-synthetic.json" --trials-dir /tmp/remeasure --timeout 150 2>&1 \
      | tee -a "$out/remeasure.log" | quiet
    python3 - "$data" /tmp/jpegs-x4 <<'PY'
import os, sys
from pathlib import Path
src, dst = Path(sys.argv[1]) / "train", Path(sys.argv[2]) / "train"
for cls in sorted(d for d in src.iterdir() if d.is_dir()):
    (dst / cls.name).mkdir(parents=True, exist_ok=True)
    for f in cls.iterdir():
        for k in range(4):
            link = dst / cls.name / f"{k}_{f.name}"
            if not link.exists():
                os.link(f, link)
print("train view:", sum(1 for _ in dst.rglob("*.jpg")), "files")
PY
    tr=/tmp/train-run; rm -rf "$tr"
    flags=(--config "$out/best.yaml" --epochs "${TRAIN_EPOCHS:-3}" --out "$tr" --no-progress
           --set data.path=/tmp/jpegs-x4 --set data.val_fraction=0.01)
    python3 -m autotune train "${flags[@]}" > "$out/train-1.log" 2>&1 &
    pid=$!
    until [ -n "$(find "$tr" -name "ckpt-*.pt" 2>/dev/null)" ] || ! kill -0 $pid 2>/dev/null; do sleep 1; done
    sleep 2; kill -TERM $pid; wait $pid; echo "first run (interrupted): exit $?"
    quiet < "$out/train-1.log" | tail -8
    python3 -m autotune train "${flags[@]}" --resume 2>&1 | tee "$out/train-2.log" | quiet
    # One archive, so a call that also searched stays inside the 8 files that come back.
    cp "$tr/train-summary.json" "$tr/train.log" "$out/" 2>/dev/null
    (cd "$out" && tar czf final.tgz remeasure.log compare-*.json train-1.log train-2.log train-summary.json train.log \
      && rm -f remeasure.log compare-*.json train-1.log train-2.log train.log)
    exit 0 ;;
  *) runs="$stage $*" ;;
esac
python3 bench/run.py --data "$data" --out "$out/results.json" --trials-dir /tmp/bench-trials --timeout 150 ${BENCH_ARGS:-} $runs 2>&1 \
  | tee "$out/run.log" | quiet
tar czf "$out/trials.tgz" -C /tmp bench-trials
if [ "$stage" = job ]; then
  # The nvJPEG pipeline alone on one GPU: decode, crop, full pipeline by worker count (and its accuracy checks).
  timeout 150 python3 bench/pipeline_gpu.py "$data" --out "$out/pipeline_gpu.json" --workers 6,15 --seconds 5 2>&1 \
    | tail -40
fi
python3 - "$out/results.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{'run':<22}{'imgs/s':>10}{'spread':>8}{'util%':>7}{'memGiB':>8}{'cpu%':>6}{'launch':>7}{'wall':>6}")
for r in rows:
    print(f"{r['name']:<22}{(r.get('imgs_per_s') or 0):>10,.0f}{(r.get('spread') or 0):>8.3f}"
          f"{(r.get('util_mean') or 0):>7.1f}{(r.get('mem_used_max_mib') or 0) / 1024:>8.1f}"
          f"{(r.get('cpu_busy_pct') or 0):>6.0f}{(r.get('launch_s') or 0):>7.1f}{r.get('bench_wall_s', 0):>6.0f}"
          f"  {r.get('failure') or ''} {(r.get('failure_message') or '')[:80]}")
PY
