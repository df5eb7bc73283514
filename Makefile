# The two entry points of the README. Each creates the virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo burst zoo test lint gpu-check clean-venv

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev,compiler]'
	touch $(STAMP)

# The README's main job: the paper's figures 12-14 (memory, throughput, latency): the three bundled
# workflows, every system of Table 2 the replay knows, the same arrivals from the shipped Azure sample.
demo: $(STAMP)
	$(VENV)/bin/streambox paper 12 13 14 --out runs/demo

burst: $(STAMP)
	$(VENV)/bin/streambox burst traffic

zoo: $(STAMP)
	$(VENV)/bin/streambox demo

test: $(STAMP)
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# For whoever has a real NVIDIA GPU (under 10 minutes): the gpu-marked tests (a process per file), every
# zoo model's per-kernel times written as calibration tables beside the plans (and as JSON under $OUT when
# set), their error against the cost model, host time per kernel on the GPU, and a short Traffic replay
# on the CUDA backend. Without a GPU: one line, exit 0.
gpu-check: $(STAMP)
	if command -v nvidia-smi >/dev/null && ! $(VENV)/bin/python -c 'import cuda.bindings' 2>/dev/null; then \
		$(VENV)/bin/pip install --quiet -e '.[cuda]'; fi
	$(VENV)/bin/python -m streambox.gpu_check

clean-venv:
	rm -rf $(VENV)
