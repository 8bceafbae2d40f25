# Two commands for a fresh machine:  make demo   |   make test
# Both create .venv and install the pinned dependencies; the demo runs the trained checkpoint committed
# in checkpoints/notes, the tests build the tiny random checkpoint first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zipmoe-installed
CHECKPOINT ?= checkpoints/tiny
PYTEST_ARGS ?=

.PHONY: install checkpoint demo test test-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

checkpoint: $(CHECKPOINT)/sere.safetensors

# The builder skips a checkpoint that is up to date, leaving its stamp (and so this rule) untouched.
$(CHECKPOINT)/zipmoe_build.json: $(STAMP) build/tiny_checkpoint.py
	$(PY) -m zipmoe.build.tiny_checkpoint --out $(CHECKPOINT)

$(CHECKPOINT)/sere.safetensors: $(CHECKPOINT)/zipmoe_build.json build/sere_calibrate.py
	$(VENV)/bin/zipmoe calibrate $(CHECKPOINT) --device cpu

# The demo runs the trained checkpoint committed in checkpoints/notes (build/train_tiny.py made it);
# DEMO_CHECKPOINT=DIR runs another one.
DEMO_CHECKPOINT ?=
demo: $(STAMP)
	$(VENV)/bin/zipmoe demo $(if $(DEMO_CHECKPOINT),--checkpoint $(DEMO_CHECKPOINT))

test: checkpoint
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu: checkpoint
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(CHECKPOINT)
