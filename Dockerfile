# visionserve: CPU or NVIDIA GPU (the PyPI torch wheel carries its CUDA libraries; the host needs the NVIDIA
# driver and Container Toolkit). Build: docker build -t visionserve .   Run: docker compose up
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
WORKDIR /app
# g++ compiles the AOTInductor package at export; only this stage has it: the running image loads the compiled
# package and needs no compiler.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
# Dependencies first, so code changes do not reinstall torch.
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY models/ models/
# The default model is exported at build time from the packaged ImageNet weights, with its ONNX file (served by
# ONNX Runtime on a CPU) and its CPU AOTInductor package (compiled here, about a minute): the image starts with no
# network and no host files, and what it serves is fixed by the image tag. Mount another export or a model repository
# to override. A CUDA package needs the GPU it runs on: compile it on such a machine (python -m models.export
# --packages cpu,cuda) and mount the export. An export that could not write its ONNX file says why and serves
# TorchScript; here that fails the build instead of shipping an image half as fast on a CPU.
RUN python -m models.export --default --out /app/weights --packages onnx,cpu && test -f /app/weights/model.onnx

FROM python:3.11-slim
# curl answers the HEALTHCHECK; the Debian version follows the base image's security updates.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 visionserve
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    VISIONSERVE_WEIGHTS_DIR=/app/weights VISIONSERVE_BIND=0.0.0.0:8000
WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app/weights /app/weights
COPY app/ app/
COPY models/ models/
COPY bin/ bin/
COPY gunicorn.conf.py .
USER 10001
EXPOSE 8000
# /readyz where VISIONSERVE_BIND says (`docker run -e VISIONSERVE_BIND=0.0.0.0:PORT` moves it)
HEALTHCHECK --interval=10s --timeout=3s --start-period=90s --retries=3 CMD ["bin/healthcheck"]
CMD ["bin/serve"]
