#!/usr/bin/env bash
# The wheels a device machine needs but cannot download (it has no network), for its CPython 3.12 on
# x86-64 Linux, into .whl/ (gitignored; the device tool carries it with carry=[".whl"]):
# - cuDNN's frontend 1.18.0: train.attention=cudnn, the engine's attention at head size 64;
# - .whl/deps/: jsonschema and what it needs, which the device image lacks (andrea validates its config).
#
#   bash bench/carry_wheels.sh                      # here, where the package registries can be reached
#   # on the device, bench/device_queue.sh installs them under /tmp and sets PYTHONPATH before its jobs
set -euo pipefail
cd "$(dirname "$0")/.."
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p .whl/deps
pip download -q --no-deps "${plat[@]}" -d .whl nvidia-cudnn-frontend==1.18.0
pip download -q "${plat[@]}" -d .whl/deps 'jsonschema>=4.18'
ls .whl .whl/deps
