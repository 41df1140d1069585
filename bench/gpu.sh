#!/usr/bin/env bash
# The benchmarks of a GPU machine in as few invocations as possible, on any machine kind (nvidia-h200, -x2, -x4,
# -x8): every stage uses every visible GPU (a search, a bench row, the drill) unless it says otherwise. From the repo root on the
# GPU machine, after the wheel install line:
#
#   bash bench/gpu.sh STAGE [STAGE ...]
#
#   compare        fresh-process rows of bench/run.py (ROWS) with this tree, and OLD_ROWS with the tree in $OLD
#                  (a `git archive` of an earlier commit, carried beside this one) run the same way, named old-*
#   search=N       N trials of the resnet50 study on the generated JPEGs (resumes it; starts no trial after the call's
#                  deadline, CALL_S seconds after the script began, minus a margin for the trial in flight)
#   final[=STUDY]  STUDY's (default $FINAL_STUDY, else resnet50) best exported and re-measured in a fresh process, and
#                  two more trials re-measured (the best with a CPU decode, the best with a GPU decode; FINAL_ROLES
#                  picks, default best,cpu-decode,gpu-decode); then a short `autotune train` of the best's export
#                  (two epochs of a hard-linked view of the JPEGs, sized to ~TRAIN_S=40 s at the search's pace, so
#                  epoch starts weigh as little as on a real data set; TRAIN_S=0: none) with its imgs/s and loss
#                  against the search's figure and the re-measure. Everything, the export included, in
#                  final-STUDY.json (the YAML itself stays at $SCRATCH/state/best-STUDY.yaml); HAND rows
#                  (bench/run.py) into hand.json if named. ~40 s per re-measure + TRAIN_S + ~30 s.
#   RUN            any bench/run.py row by name
#   search=N[@S]   as above, with a time budget of its own (S seconds, never past the call's deadline);
#                  SEARCH_STUDY=NAME: another study of the same spec (a fresh search beside one already there)
#   script=N[@S]   a fresh search of the seed example script (examples/seed_ddp.py, a fresh torchrun per trial) on
#                  the same JPEGs; script-fn=N[@S]: the same script as a function on a live worker (seed_ddp.py:main);
#                  their studies are seed-script and seed-fn (final=seed-fn re-measures and trains its best);
#                  folder=N[@S]: examples/folder_ddp.py:main, a script with its own ImageFolder and DataLoader handed
#                  to run.loader (study folder-fn; where its own loader bounds it, the project's fastest pipeline is
#                  measured once on the same folder, and its show says both figures; FOLDER_COPIES=K: its data a
#                  hard-linked view holding every training JPEG K times, study folder-fn-xK: epochs K times longer, as
#                  on a real data set, where 32,000 images at batch 512 make 62-step epochs); lightning=N[@S]:
#                  examples/lightning_ddp.py:main, the same ResNet-50 as a Lightning DataModule (its train images
#                  through run.image_loader), LightningModule and Trainer tuned through trainer.runtime.lightning,
#                  trial after trial on a live worker, with stages (study lightning-fn; final=lightning-fn re-measures
#                  and trains its best); against search=N@S in the same call for the ratio. lm=N[@S]:
#                  examples/tiny_lm.py:main, a small transformer on generated tokens (study lm-fn): whether the stages
#                  weigh torch.compile where the model alone leaves the GPU idle. hf=N[@S]: examples/hf_trainer_lm.py:main,
#                  a small causal LM trained by a Hugging Face Trainer through trainer.runtime.transformers (study
#                  hf-fn; final=hf-fn re-measures its best in a fresh process). SCRIPT_SPEC=FILE: these
#                  script stages' searches with that spec (`--spec`: its space narrows or widens theirs), each study's
#                  name followed by -FILE's stem
#   model=NAME[@S] a fresh search (MODEL_TRIALS trials at most, default 40) of a torchvision classifier by name (--model NAME) on the same JPEGs
#   hand=ROWS      bench/run.py rows into hand.json; hand-NAME=ROWS: the same rows with --set model.name=NAME (and
#                  the model family's optimizer: AdamW 1e-3 for convnext/vit/swin/maxvit)
#   Every study of these stages lives in one database, studies.db; `autotune show` of each goes to tables.txt.
#   rows=A,B,...   several bench/run.py rows in one run: one rows.json and one table (issue #22's rows: ceil-*,
#                  supply-*, e2e-*; bench/run.py says each row's estimated wall time)
#   ddp[=ceil]     issue #21's DDP and NCCL knobs, each alone on the best known end-to-end config (bench/run.py
#                  DDP_ROWS: ddp-base, ddp-bucket-5, ddp-bucket-100, ddp-gabv, ddp-static, nccl-ring, nccl-tree,
#                  nccl-simple, nccl-ll), one table against ddp-base, in ddp.json; =ceil: the same knobs on the compute
#                  ceiling (synthetic data; ceil-ddp-*, ceil-nccl-*) in ddp-ceil.json. ~35 s a row, ~5.5 min; no row
#                  starts after the call's deadline minus 60 s (those left are listed as not run)
#   drill          bench/drill.py: a tiny search on the real process group (NCCL): a healthy trial, the last rank
#                  SIGKILLed mid-trial, the last rank hung mid-trial (its peers in the all-reduce), a healthy trial;
#                  checks each failure's class, the trial after them, no process and no GPU memory left (drill.json,
#                  ~2.5 min: the hang costs the drill's 40 s trial timeout)
#   scale[=SRC]    one config at --nproc-per-node 1 and N (every visible GPU): both figures, their losses and the
#                  scaling efficiency N-GPU / (N x 1-GPU) in scale.json. SRC: a bench/run.py row, a study (its
#                  fastest feasible trial, exported without a re-measure), or a YAML; default: final's export of
#                  resnet50 (best-resnet50.yaml) if this machine made one, else the resnet50 study, else the row
#                  ddp-base (the best known end-to-end config). ~90 s
#   profile        bench/profile_step.py: ResNet-50's step, eager vs compiled vs CUDA graphs, top kernels
#                  (profile.json; PROFILE_MODES, default eager,compile,cudagraphs; ~4 min cold, not measured);
#                  PROFILE_SET="data.decode=dali data.dali_threads=13 ...": the steps fed by that input pipeline on
#                  the generated JPEGs instead of a synthetic batch, with the host's wait for each batch and the
#                  device's idle share (issue #26: the best DALI trials ran the GPU 93-97 % busy, the ceiling 100 %),
#                  each mode first on a synthetic batch (its compile then read back from the on-disk caches)
#   pipeline       bench/pipeline_gpu.py: where the nvjpeg-gpu and hybrid paths' time goes (pipeline.json, ~2 min)
#   dali           issue #26's rows: DALI's supply alone (hw_decoder_load 0.65, 0.5, 0.95) and end to end (eager,
#                  compiled) beside nvJPEG's and the hybrid's, each with its loss, in dali.json (DALI_ROWS; ~35 s a
#                  row, ~80 s more for the compile; no row starts after the call's deadline minus 60 s). Needs
#                  nvidia.dali (the split wheels' install line first); without it the stage says so and runs nothing.
#                  DALI_ROWS=shapes: issue #41's rows instead, the shape of DALI's graph (bench/run.py SHAPES:
#                  16 rows, about one call)
#
# Everything comes back in at most 8 files under $OUT: call.log (all output), studies.db (every study: `autotune show
# --storage sqlite:///studies.db --study NAME`), tables.txt, trials.tgz, and the JSON of the bench stages run (count
# them when planning a call: each final=STUDY, ddp, drill, scale and rows= adds one).
# Studies also resume on a fresh machine from bench/state/studies.db when that is carried.
# SCRIPT_ARGS: words passed to the script of a script=, script-fn=, folder= or lightning= stage after its --data
# (e.g. "--lr 0.025" where its own learning rate diverges at fp16).
# SCRATCH (default /tmp): where the state (studies, trials, exports) and the bench rows' trial folders go.
# DRY=1: the same stages on a machine without GPUs at toy sizes (ResNet-18, 32 px; one rank, two gloo ranks for the
# drill and scale's N): checks the plumbing only.
set -uo pipefail
t0=$(date +%s)
out=$(realpath -m "${OUT:-bench/out}"); mkdir -p "$out"
exec > >(tee -a "$out/call.log") 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
scratch=$(realpath -m "${SCRATCH:-/tmp}")
data=${DATA:-/tmp/jpegs}; state=$scratch/state; db="sqlite:///$state/studies.db"
call_s=${CALL_S:-570}
rows=${ROWS:-synthetic-fp16 strong-synthetic strong-nvjpeg-fp16 strong-nvjpeg-bf16 strong-hybrid-fp16-25}
old_rows=${OLD_ROWS:-synthetic-fp16 strong-synthetic strong-nvjpeg-bf16}
hand=${HAND:-}
images=${IMAGES:-32000}
# The studies' head: 100 classes, as the generated data has (the bench configs' default is ImageNet's 1000). A trial
# timeout of 150 s: the stages measure torch.compile only where a compiled run fits well inside it (a cold compile
# of ResNet-50 took most of a minute on 1xH200).
bench_set=(--set data.num_classes=100); search_set=(--trial-timeout "${TRIAL_TIMEOUT:-150}")
# BENCH_SET="KEY=VALUE ...": more settings for every bench/run.py row of the call (e.g. measure.profile_steps=10: each
# row's step split in its JSON, step_split).
for kv in ${BENCH_SET:-}; do bench_set+=(--set "$kv"); done
if [ -n "${DRY:-}" ]; then  # toy sizes for a CPU smoke run
  images=400
  bench_set+=(--set model.name=resnet18 --set data.image_size=32 --set training.batch_size=8
             --set loader.num_workers=1 --set measure.window_s=0.5 --set measure.warmup_min_steps=2)
  search_set=(--model resnet18 --image-size 32 --trial-timeout 120 --nproc-per-node 1)  # one rank: 2 cores
fi
# Line-buffered: a stage the call's limit cuts short must leave what it printed in call.log (a buffered grep lost a
# whole stage's output once).
quiet() { grep --line-buffered -v "^W1\|^\*\*\*\|OMP_NUM_THREADS\|^  trial .* window\|^  trial .* warm-up\|^  trial .* measuring"; }
left() { echo $(( t0 + call_s - $(date +%s) )); }
# The folder a script's own loader reads: with FOLDER_COPIES=K > 1 a hard-linked view holding every training JPEG K
# times (epochs K times longer, as on a real data set), else the training folder itself.
folder_view() {
  local view=$scratch/folder-view-x${FOLDER_COPIES:-1}
  if [ "${FOLDER_COPIES:-1}" -gt 1 ] && python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path
from remeasure import link_view
n = link_view(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
print(f'folder: {n} JPEGs linked in {sys.argv[2]}')
sys.exit(0 if n else 1)" "$data/train" "$view" "$FOLDER_COPIES" >&2; then echo "$view"; else echo "$data/train"; fi
}
#   rounds         bench/loader_rounds.py: examples/folder_ddp.py's own DataLoader (on the FOLDER_COPIES view when
#                  set), every batch's arrival time alone and ahead of ResNet-50, by its workers (ROUNDS_RUNS, default
#                  alone:16:2 model:16:2 alone:14:2 model:14:2 model:12:2 model:14:4 model:16:4; ROUNDS_S=30 s each):
#                  how much windows of 2, 4 and 8 worker rounds swing, and the CPU's busy and steal time (rounds.json)
# The studies and every trial's files (configs, logs, JSON lines; no checkpoint, no database copy) into $OUT: after
# each stage that adds to them, so a call cut short keeps what its finished stages made.
pack() {
  cp "$state/studies.db" "$out/studies.db" 2>/dev/null
  tar czf "$out/trials.tgz" -C "$state" --exclude='*.pt' --exclude='*.db' --exclude='compile-cache' . || true
}
# A call cut short by its limit keeps the stage in flight's studies and trial logs too: a folder= stage whose trials
# took ~100 s ran past the call's 600 s, and its study and logs were lost with it. The stages run in a background
# subshell the script waits for: bash runs a trap at once inside `wait`, while in a foreground pipeline whose Python
# dies of the same SIGTERM it was seen to end without running it.
trap 'trap "" PIPE; pack; echo "== stopped $(( $(date +%s) - t0 )) s into the call; packed what the stage in flight made"; exit 124' TERM INT

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, \
'gpus', torch.cuda.device_count(), 'cpus', __import__('os').cpu_count())"
git log -1 --format='tree: %h %s' 2>/dev/null || true
python3 -c "import lightning, accelerate; print('lightning', lightning.__version__, 'accelerate', accelerate.__version__)" \
  2>/dev/null || echo "lightning, accelerate: not both installed (the lightning= stage needs lightning)"
# A study carried from an earlier call (a machine that was given back in between) continues here.
mkdir -p "$state"
[ -f "$state/studies.db" ] || [ ! -f bench/state/studies.db ] || cp bench/state/studies.db "$state/"
# ImageNet-like JPEGs in 100 class folders, made once per machine.
python3 -m autotune make-data "$data" --images "$images" --classes 100 --no-progress 2>&1 | tail -1

(for stage in "$@"; do
  echo "== $stage ($(( $(date +%s) - t0 )) s into the call)"
  case "$stage" in
    compare)
      python3 bench/run.py --data "$data" --out "$out/compare-new.json" --trials-dir $scratch/bench-new --timeout 150 \
        "${bench_set[@]}" $rows 2>&1 | quiet
      if [ -n "${OLD:-}" ]; then
        (cd "$OLD" && PYTHONPATH="/tmp/site:$PWD" python3 bench/run.py --data "$data" \
          --out "$out/compare-old.json" --trials-dir $scratch/bench-old --timeout 150 "${bench_set[@]}" \
          $old_rows 2>&1 | quiet)
      fi
      python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = json.loads((out / "compare-new.json").read_text())
old = out / "compare-old.json"
if old.exists():
    rows += [{**r, "name": "old-" + r["name"]} for r in json.loads(old.read_text())]
(out / "compare.json").write_text(json.dumps(rows, indent=1, default=str))
for f in ("compare-new.json", "compare-old.json"):
    (out / f).unlink(missing_ok=True)
PY
      ;;
    final|final=*)
      study=${stage#final}; study=${study#=}; study=${study:-${FINAL_STUDY:-resnet50}}
      # The training images one epoch of a short train run reads (make-data's train/ folder).
      n_train=$(find "$data/train" -name '*.jpg' 2>/dev/null | wc -l)
      python3 bench/remeasure.py --storage "$db" --study "$study" --out "$out/final-$study.json" \
        --yaml "$state/best-$study.yaml" --timeout 150 --roles "${FINAL_ROLES:-best,cpu-decode,gpu-decode}" \
        --train-s "${TRAIN_S:-40}" --train-images "$n_train" --train-dir "$state/train-$study" \
        --train-view "$scratch/train-view-$study" \
        --deadline-s "$(( $(left) - 10 ))" 2>&1 | quiet
      pack
      if [ -n "$hand" ]; then
        python3 bench/run.py --data "$data" --out "$out/hand.json" --trials-dir "$scratch/bench-hand" --timeout 150 \
          "${bench_set[@]}" $hand 2>&1 | quiet
      fi
      ;;
    ddp|ddp=ceil)
      if [ "$stage" = ddp ]; then list=(ddp-base ddp-bucket-5 ddp-bucket-100 ddp-gabv ddp-static nccl-ring nccl-tree
                                        nccl-simple nccl-ll); json=ddp.json; else
        list=(ceil-ddp-base ceil-ddp-bucket-5 ceil-ddp-bucket-100 ceil-ddp-gabv ceil-ddp-static ceil-nccl-ring
              ceil-nccl-tree ceil-nccl-simple ceil-nccl-ll); json=ddp-ceil.json; fi
      python3 bench/run.py --data "$data" --out "$out/$json" --trials-dir "$scratch/bench-ddp" --timeout 150 \
        --against "${list[0]}" --start-before "$(( $(left) - 60 ))" "${bench_set[@]}" "${list[@]}" 2>&1 | quiet ;;
    drill)
      # The failures hit the last rank of every visible GPU's world; DRY: two gloo ranks (the drill's net is tiny).
      dr=(); [ -n "${DRY:-}" ] && dr=(--nproc 2 --trial-timeout 25)
      python3 bench/drill.py --out "$out/drill.json" --work "$state/drill" --data "$data" "${dr[@]}" 2>&1 | quiet
      pack ;;
    scale|scale=*)
      src=${stage#scale}; src=${src#=}; sc=()
      if [ -z "$src" ] && [ -f "$state/best-resnet50.yaml" ]; then sc=(--config "$state/best-resnet50.yaml")
      elif [ -z "$src" ]; then sc=(--study resnet50 --storage "$db" --or-row ddp-base --data "$data" "${bench_set[@]}")
      elif [ -f "$src" ]; then sc=(--config "$src")
      elif python3 -c "import sys; sys.path.insert(0, 'bench'); import run; sys.exit('$src' not in run.PLAN)" \
           2>/dev/null; then sc=(--row "$src" --data "$data" "${bench_set[@]}")
      else sc=(--study "$src" --storage "$db"); fi
      [ -n "${DRY:-}" ] && [ "${sc[0]}" != --row ] && sc+=(--set measure.window_s=0.5 --set measure.warmup_min_steps=2)
      python3 bench/scale.py --out "$out/scale.json" --trials-dir "$scratch/bench-scale" --timeout 150 "${sc[@]}" \
        2>&1 | quiet ;;
    search=*|script=*|script-fn=*|folder=*|lightning=*|lm=*|hf=*|model=*)
      kind=${stage%%=*}; arg=${stage#*=}; n=${arg%@*}; secs=${arg#*@}; [ "$secs" = "$arg" ] && secs=
      # The trial in flight when it runs out still ends inside the call: a script's own loader measured in windows
      # of four rounds took ~125 s a trial (folder=, 1xH200), the others under 45 s.
      margin=45; [ "$kind" = folder ] && margin=150
      budget=$(( $(left) - margin ))
      [ -n "$secs" ] && [ "$secs" -lt "$budget" ] && budget=$secs
      case "$kind" in
        search) name=${SEARCH_STUDY:-resnet50}; what=(--spec resnet50 --data "$data" "${search_set[@]}") ;;
        script) name=seed-script; what=(--script examples/seed_ddp.py) ;;
        script-fn) name=seed-fn; what=(--script examples/seed_ddp.py:main) ;;
        folder) name=folder-fn; what=(--script examples/folder_ddp.py:main) ;;
        lightning) name=lightning-fn; what=(--script examples/lightning_ddp.py:main) ;;
        lm) name=lm-fn; what=(--script examples/tiny_lm.py:main) ;;
        hf) name=hf-fn; what=(--script examples/hf_trainer_lm.py:main) ;;
        model) name="held-$n"; what=(--spec resnet50 --model "$n" --data "$data" "${search_set[@]}"); n=${MODEL_TRIALS:-40} ;;
      esac
      extra=(); train=$data/train
      if [ "$kind" = folder ] && [ "${FOLDER_COPIES:-1}" -gt 1 ]; then
        name=folder-fn-x$FOLDER_COPIES; train=$(folder_view)
      fi
      if [ "$kind" = lm ] || [ "$kind" = hf ]; then  # their own generated tokens: no data folder
        what+=(--trial-timeout "${TRIAL_TIMEOUT:-150}"); [ -n "${DRY:-}" ] && what+=(--nproc-per-node 1)
      elif [ "$kind" = script ] || [ "$kind" = script-fn ] || [ "$kind" = folder ] || [ "$kind" = lightning ]; then
        what+=(--trial-timeout "${TRIAL_TIMEOUT:-150}"); [ -n "${DRY:-}" ] && what+=(--nproc-per-node 1)
        extra=(-- --data "$train"); [ -n "${DRY:-}" ] && extra+=(--model resnet18 --image-size 32)
        # shellcheck disable=SC2206  # SCRIPT_ARGS: words for the script's own parser, e.g. "--lr 0.025"
        [ -n "${SCRIPT_ARGS:-}" ] && extra+=(${SCRIPT_ARGS})
        if [ -n "${SCRIPT_SPEC:-}" ]; then what+=(--spec "$SCRIPT_SPEC"); name=$name-$(basename "$SCRIPT_SPEC" .yaml); fi
      fi
      if [ "$budget" -gt 30 ]; then
        python3 -m autotune search --storage "$db" --study "$name" --trials "$n" --timeout "$budget" "${what[@]}" \
          "${extra[@]}" 2>&1 | quiet
      else
        echo "$stage: only $(left) s left in this call; not started"
      fi
      { echo "== $stage"; python3 -m autotune show --storage "$db" --study "$name"; } >> "$out/tables.txt" 2>&1
      tail -6 "$out/tables.txt"
      pack ;;
    hand=*|hand-*=*)
      list=${stage#*=}; model=${stage%%=*}; model=${model#hand}; model=${model#-}; hset=()
      if [ -n "$model" ]; then
        hset=(--set "model.name=$model")
        case "$model" in convnext*|vit*|swin*|maxvit*) hset+=(--set optimizer.name=adamw --set optimizer.lr=0.001
                                                              --set optimizer.weight_decay=0.05) ;; esac
      fi
      python3 bench/run.py --data "$data" --out "$out/hand-${model:-resnet50}.json" --trials-dir $scratch/bench-hand \
        --timeout 150 "${bench_set[@]}" "${hset[@]}" ${list//,/ } 2>&1 | quiet ;;
    rows=*)
      list=${stage#rows=}
      python3 bench/run.py --data "$data" --out "$out/rows.json" --trials-dir $scratch/bench-rows --timeout 180 \
        "${bench_set[@]}" ${list//,/ } 2>&1 | quiet ;;
    profile)
      if [ -n "${DRY:-}" ]; then prof=(--cpu-smoke --modes "${PROFILE_MODES:-eager,compile}"); else
        prof=(--modes "${PROFILE_MODES:-eager,compile,cudagraphs}"); fi
      if [ -n "${PROFILE_SET:-}" ]; then
        prof+=(--data "$data/train" --synthetic-too); for kv in $PROFILE_SET; do prof+=(--set "$kv"); done; fi
      python3 bench/profile_step.py --out "$out/profile.json" "${prof[@]}" 2>&1 | quiet ;;
    rounds)
      view=$(folder_view)
      rr=(--seconds "${ROUNDS_S:-30}"); [ -n "${DRY:-}" ] && rr=(--seconds 3 --batch 8 --image-size 32)
      python3 bench/loader_rounds.py "$view" --out "$out/rounds.json" "${rr[@]}" \
        ${ROUNDS_RUNS:-alone:16:2 model:16:2 alone:14:2 model:14:2 model:12:2 model:14:4 model:16:4} 2>&1 | quiet ;;
    pipeline)
      if [ -n "${DRY:-}" ]; then pipe=(--cpu-smoke); else pipe=(--hybrid 0.5 --workers 6 --train); fi
      python3 bench/pipeline_gpu.py "$data/train" --out "$out/pipeline.json" --batch 512 "${pipe[@]}" 2>&1 | quiet ;;
    dali)
      if ! python3 -c "import nvidia.dali" 2>/dev/null; then
        echo "dali: nvidia.dali does not import here: pip install 'ddp-autotune[dali]' (or the split wheels); not run"
      else
        dflt="supply-nvjpeg supply-split-50-0 supply-dali supply-dali-hw-50 supply-dali-hw-95 e2e-nvjpeg e2e-hybrid-50"
        dflt+=" e2e-dali"; [ -z "${DRY:-}" ] && dflt+=" e2e-dali-compile"  # DRY: Inductor's C++ compile takes minutes
        rows=${DALI_ROWS:-$dflt}; [ "$rows" = shapes ] && rows=$(python3 bench/run.py --list shape- ; \
          python3 bench/run.py --list supply-shape-)
        list=($rows)
        python3 bench/run.py --data "$data" --out "$out/dali.json" --trials-dir "$scratch/bench-dali" --timeout 180 \
          --start-before "$(( $(left) - 60 ))" "${bench_set[@]}" "${list[@]}" 2>&1 | quiet
      fi ;;
    *)
      python3 bench/run.py --data "$data" --out "$out/runs.json" --trials-dir $scratch/bench-runs --timeout 150 \
        "${bench_set[@]}" "$stage" 2>&1 | quiet ;;
  esac
done) & wait $!
echo "== done in $(( $(date +%s) - t0 )) s"
