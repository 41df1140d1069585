#!/usr/bin/env bash
# The diagnostic of session 8 as it ran (bench/RESULTS.md): AUTOTUNE_DALI_READER and AUTOTUNE_DALI_FEED_THREADS were
# switches of a diagnostic build of trainer/data/dali.py at 5613655, never committed; d85f998 keeps the reader.
set -uo pipefail
out=${OUT:-/tmp/diag}; mkdir -p "$out"
exec > >(tee -a "$out/call.log") 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
data=/tmp/jpegs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import nvidia.dali as d; print('dali', d.__version__)"
python3 -m autotune make-data "$data" --images 32000 --classes 100 --no-progress 2>&1 | tail -1
P() { name=$1; shift; echo "== $name ($(( $(date +%s) - t0 )) s)";
  timeout 240 python3 bench/profile_step.py --out "$out/p-$name.json" --steps 20 --warmup 12 --top 12 "$@" 2>&1 \
    | grep -v "^W1\|gpuGetDeviceCount" | grep -A14 "ms/step" | head -30; }
D=(--data $data/train --set data.decode=dali --set data.dali_threads=8)
[ -n "${NOSYNTH:-}" ] || P synth --modes eager,compile
P ext65 --modes eager,compile "${D[@]}"
P ext100 --modes compile "${D[@]}" --set data.dali_hw_decoder_load=1.0
AUTOTUNE_DALI_FEED_THREADS=2 P ext65f2 --modes compile "${D[@]}"
AUTOTUNE_DALI_READER=file P file65 --modes eager,compile "${D[@]}"
AUTOTUNE_DALI_READER=file P file100 --modes compile "${D[@]}" --set data.dali_hw_decoder_load=1.0
P nvjhw --modes eager --data $data/train --set data.decode=hybrid --set data.hybrid_cpu_fraction=0.0 \
  --set data.hybrid_hw_fraction=1.0 --set loader.num_workers=6
[ -n "${NOSYNTH:-}" ] || P nvjgpu --modes eager --data $data/train --set data.decode=nvjpeg-gpu --set loader.num_workers=6
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); rows = {}
for f in sorted(out.glob("p-*.json")):
    rows[f.stem[2:]] = json.loads(f.read_text()); f.unlink()
(out / "profiles.json").write_text(json.dumps(rows, indent=1))
print(f"{'variant':10} {'mode':8} {'imgs/s':>8} {'ms/step':>8} {'input ms':>9} {'dev idle':>9} {'loss':>7}")
for name, r in rows.items():
    for m in r["modes"]:
        print(f"{name:10} {m['mode']:8} {m['imgs_per_s']:8,.0f} {m['step_ms']:8.1f} {m['input_ms'] or 0:9.2f} "
              f"{100 * (m['device_idle'] or 0):8.1f}% {m['loss']:7.3f}")
PY
echo "== done in $(( $(date +%s) - t0 )) s"
