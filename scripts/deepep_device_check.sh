#!/usr/bin/env bash
# DeepEP ("deepep") on a 2-GPU host in one call: build DeepEP v1.2.1 from .deepep/src (carried; see docs/deepep.md)
# into a folder outside the repository, then run scripts/deepep_check.py on both GPUs with torchrun.
#
#   bash scripts/deepep_device_check.sh [deepep_check.py arguments, e.g. --ops-only]
#
# Environment (all optional): DEEPEP_BUILD (default /tmp/deepep: reused when it already imports), NPROC (2),
# WHEELS (a folder of wheels for what the device lacks, e.g. stevedore; default .whl), CHECK_TIMEOUT (seconds, 230),
# DEEPEP_PYTEST=1 also runs the GPU tests of tests/vendors/cuda/test_cuda_deepep.py afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
src=$repo/.deepep/src
build=${DEEPEP_BUILD:-/tmp/deepep}
nproc=${NPROC:-2}
wheels=${WHEELS:-.whl}
py=${PYTHON:-$(command -v python3 || command -v python)}
start=$SECONDS

fail() { echo "ERROR: $*" >&2; exit "${2:-2}"; }

[ -f "$src/setup.py" ] || fail "$src/setup.py is missing: fetch DeepEP v1.2.1 into .deepep/src and name .deepep/src \
in the device call's carry (docs/deepep.md)"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$py" - <<'EOF' || fail "torch with CUDA is needed"
import torch
print(f"torch {torch.__version__} CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
assert torch.cuda.is_available()
EOF
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge "$nproc" ] || fail "$nproc GPUs needed, $gpus visible"

# moe-hal's own dependencies (hal imports stevedore and rich): from $wheels where the device lacks them.
if ! "$py" -c "import stevedore, rich" 2>/dev/null; then
  ls "$wheels"/*.whl >/dev/null 2>&1 || fail "stevedore/rich missing and no wheels in $wheels (carry them)"
  "$py" -m pip install --quiet --no-index --no-deps "$wheels"/*.whl || fail "installing the wheels of $wheels failed"
fi

# DeepEP: build_ext --inplace in a copy outside the checkout (the repository stays clean), reused while it imports.
if PYTHONPATH=$build "$py" -c "import deep_ep" 2>/dev/null; then
  echo "DeepEP: reusing the build in $build"
else
  tuple=$(find /usr/local/cuda*/targets/*/include/cccl /usr/local/cuda*/include/cccl -path '*/cuda/std/tuple' \
          -print -quit 2>/dev/null)
  [ -n "$tuple" ] || fail "CUDA's CCCL headers (cccl/cuda/std/tuple) not found under /usr/local/cuda*"
  cccl=${tuple%/cuda/std/tuple}
  rm -rf "$build" && mkdir -p "$(dirname "$build")" && cp -r "$src" "$build" || fail "copying $src to $build failed"
  echo "DeepEP: building in $build (TORCH_CUDA_ARCH_LIST=9.0, CPATH=$cccl; NVSHMEM from the nvidia-nvshmem pip package)"
  ( cd "$build" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CPATH=$cccl${CPATH:+:$CPATH} \
      "$py" setup.py build_ext --inplace ) > /tmp/deepep-build.log 2>&1
  status=$?
  if [ $status -ne 0 ]; then tail -40 /tmp/deepep-build.log; fail "the DeepEP build failed (log: /tmp/deepep-build.log)" 3; fi
  grep -E "NVSHMEM path|Arch list" /tmp/deepep-build.log
  echo "DeepEP: built in $((SECONDS - start)) s"
fi
PYTHONPATH=$build "$py" -c "import deep_ep; print('deep_ep from', deep_ep.__file__, 'sm90:', deep_ep.Buffer.is_sm90_compiled())" \
  || fail "the DeepEP build does not import"

export PYTHONPATH=$build:$repo${PYTHONPATH:+:$PYTHONPATH}
timeout "${CHECK_TIMEOUT:-230}" "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" scripts/deepep_check.py "$@"
status=$?
[ $status -eq 124 ] && echo "ERROR: scripts/deepep_check.py ran past ${CHECK_TIMEOUT:-230} s and was stopped" >&2
if [ "${DEEPEP_PYTEST:-0}" = 1 ]; then
  "$py" -m pytest tests/vendors/cuda/test_cuda_deepep.py -m gpu -q -p no:cacheprovider || status=1
fi
echo "deepep device check: exit $status after $((SECONDS - start)) s"
exit $status
