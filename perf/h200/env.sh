#!/usr/bin/env bash
# Source on the H200 machine (Ubuntu 24.04, Python 3.12, torch/triton preinstalled, no registry):
# a venv for the Triton server's Python stub with numpy 1.26 (the 2.51 stub breaks under numpy 2),
# the server binary, tritonclient and this repository importable. What it unpacks travels in the
# ignored folder .gpu/ (see README "Running on a GPU machine"):
#   .gpu/tritonserver.txz         pytriton/tritonserver + nvidia_pytriton.libs from nvidia-pytriton 0.7.0
#   .gpu/numpy-1.26.4-cp312.txz   the numpy 1.26.4 cp312 wheel's contents
#   .gpu/wheels/*.whl             tritonclient, python-rapidjson (cp312)
#   .gpu/pa/*.whl                 perf-analyzer 2.60 (optional)
set -e
REPO=$(pwd)
TORCH_SITE=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
READY=/tmp/venv/.manylora_ready  # written last: a venv an earlier failure left half made is made again
if [ ! -f "$READY" ]; then
  for f in .gpu/tritonserver.txz .gpu/numpy-1.26.4-cp312.txz; do
    if [ ! -f "$f" ]; then
      echo "env.sh: $f is missing: carry .gpu to this machine (README, 'Running on a GPU machine')" >&2
      set +e
      return 2 2>/dev/null || exit 2
    fi
  done
  rm -rf /tmp/venv
  python3 -m venv /tmp/venv
  SITE=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  tar xJf .gpu/numpy-1.26.4-cp312.txz -C "$SITE"
  tar xJf .gpu/tritonserver.txz -C "$SITE"
  /tmp/venv/bin/python -m pip install -q --no-index --no-deps .gpu/wheels/*.whl
  if ls .gpu/pa/*.whl >/dev/null 2>&1; then /tmp/venv/bin/python -m pip install -q --no-index --no-deps .gpu/pa/*.whl; fi
  echo "$REPO" > "$SITE/manylora.pth"
  echo "$TORCH_SITE" > "$SITE/zz_image_site.pth"
  touch "$READY"
fi
export PATH=/tmp/venv/bin:$PATH
export PYTHONPATH=$REPO
set +e
