#!/usr/bin/env bash
# NVIDIA DALI for an offline GPU machine that takes the project tree and at most 64 MiB of extra files with each
# command, in fewer parts than its wheels: ../shared/gpu-big-wheels.sh's wheels (~259 MB, 5 parts of 56 MiB, one
# command each) installed here for the GPU machine's Python 3.12, stripped of what a run does not load (debug symbols,
# headers, other Pythons' extension modules, nvCOMP), packed with xz: ~145 MB, 3 parts of at most 49 MiB, so the first
# part, Optuna's wheels without plotly (6 MiB: the report is not made there) and the tree (7 MiB with the results
# committed under bench/) fit one command's 64 MiB and the first command already runs a search.
# Usage, from the project root:  bash bench/dali-bundle.sh        (writes .whl-big/p1 .. p3, git-ignored)
#
# On the GPU machine a path sent with a command replaces the ignored folder it lies in, so each command copies its
# part out of the tree at once. Three commands on the same machine, one after the other:
#   1, with .whl-big/p1 and .whl-min (.whl-min: ../shared/gpu-wheels.sh's wheels less plotly's and greenlet's, which
#   only SQLAlchemy's asyncio needs: with greenlet's, the tree, p1 and .whl-min exceed 64 MiB):
#     mkdir -p /tmp/parts && cp .whl-big/p*/* /tmp/parts/ && python3 -m pip install -q --no-index --no-deps \
#       --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-min/*.whl && \
#       export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; bash bench/gpu.sh ...   (stages without DALI)
#   2, with .whl-big/p2:  cp .whl-big/p*/* /tmp/parts/ && export ... ; bash bench/gpu.sh ...
#   3, with .whl-big/p3:  the same, then DALI unpacked after the wheels (pip's --upgrade --target would
#           replace a whole top-level folder, nvidia/ included), then the command:
#     cp .whl-big/p*/* /tmp/parts/ && cat /tmp/parts/dali.tar.xz.part-* > /tmp/dali.tar.xz && \
#       python3 -c "import tarfile; tarfile.open('/tmp/dali.tar.xz').extractall('/tmp/site')" && \
#       export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; bash bench/gpu.sh ...
set -euo pipefail
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/dl" \
  nvidia-dali-cuda130==2.4.0 astunparse gast optree makefun "libcst~=1.8" nvtx nvidia-nvjpeg2k-cu13 \
  nvidia-nvtiff-cu13 "nvidia-nvimgcodec-cu13>=0.9,<0.10" 2>&1 | grep -v 'is ignored' || true
python3 -m pip install -q --no-deps --no-compile --target "$work/site" --python-version 3.12 --implementation cp \
  --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$work"/dl/*.whl
cd "$work/site"
rm -rf nvidia/dali/include
find nvidia/dali -maxdepth 1 -name '*.cpython-*.so' ! -name '*cpython-312-*' -delete
find . -name '*.so*' -type f -exec strip --strip-unneeded {} \; 2>/dev/null || true
cd - >/dev/null
rm -rf .whl-big && mkdir -p .whl-big
tar -cf - -C "$work/site" . | xz -T0 -8 > "$work/dali.tar.xz"
split -b 49M -d -a 1 "$work/dali.tar.xz" "$work/dali.tar.xz.part-"
i=0; for f in "$work"/dali.tar.xz.part-*; do i=$((i+1)); mkdir -p .whl-big/p$i; mv "$f" .whl-big/p$i/; done
if [ -d .git ] && ! grep -qx "/.whl-big/" .git/info/exclude 2>/dev/null; then echo "/.whl-big/" >> .git/info/exclude; fi
echo "$i parts:"; du -sh .whl-big/p*
# The first command's wheels: Optuna's without plotly (only the report, made here, imports it).
if [ -d .whl ]; then
  rm -rf .whl-min && mkdir .whl-min && cp .whl/*.whl .whl-min/ && rm -f .whl-min/plotly-* .whl-min/greenlet-*
  if [ -d .git ] && ! grep -qx "/.whl-min/" .git/info/exclude 2>/dev/null; then echo "/.whl-min/" >> .git/info/exclude; fi
  du -sh .whl-min
fi
