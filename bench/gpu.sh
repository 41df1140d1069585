#!/usr/bin/env bash
# All GPU work of one session, in one call on nvidia-h200-x2 (see ../shared/GPU.md). Usage, from the repo root on the
# GPU machine, after the wheel install line:  bash bench/gpu.sh STAGE [RUN ...]
# Writes JSON and logs under $OUT (default bench/out) and prints a table last.
set -uo pipefail
out=${OUT:-bench/out}; mkdir -p "$out"
stage=${1:-job}; shift || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
data=/tmp/jpegs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv,noheader
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'gpus', torch.cuda.device_count(), 'cpus', __import__('os').cpu_count())"
# 32,000 ImageNet-like JPEGs (100 class folders; the model head keeps 1000 classes, as for ImageNet).
python3 -m autotune make-data "$data" --images 32000 --classes 100 --no-progress 2>&1 | tail -1
case "$stage" in
  job) runs=${*:-seed-default strong-pil strong-tvcpu strong-synthetic bare-synthetic loader-pil loader-tvcpu loader-nvjpeg strong-nvjpeg-bf16 strong-nvjpeg-fp16} ;;
  pipeline)
    # One GPU: stage costs (wall and GPU ms), and a ResNet-50 loop fed by each pipeline in one process.
    timeout 150 python3 bench/pipeline_gpu.py "$data" --out "$out/pipeline_gpu.json" --workers 6 --hybrid 0.25,0.5 \
      --train --seconds 3 2>&1 | tail -24
    runs=${*:-strong-hybrid-fp16-50 strong-nvjpeg-fp16} ;;
  search)
    # A real search of the default GPU study on the same JPEGs. The study lives in bench/state/ (git-ignored): copy
    # the returned resnet50.db there and name bench/state in the next call's carry, and the study resumes.
    mkdir -p bench/state; db="sqlite:///$PWD/bench/state/resnet50.db"
    timeout "${SEARCH_S:-200}" python3 -m autotune search --trials "${1:-4}" --data "$data" --storage "$db" 2>&1 \
      | tee "$out/search.log" | grep -v "^W1\|^\*\*\*\|OMP_NUM_THREADS"
    python3 -m autotune show --study resnet50 --storage "$db" 2>&1 | tee "$out/search-table.txt"
    cp bench/state/resnet50.db "$out/"
    exit 0 ;;
  *) runs="$stage $*" ;;
esac
python3 bench/run.py --data "$data" --out "$out/results.json" --trials-dir /tmp/bench-trials --timeout 150 $runs 2>&1 \
  | tee "$out/run.log" | grep -v "^W1\|^\*\*\*\|OMP_NUM_THREADS"
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
