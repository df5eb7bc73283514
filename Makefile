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

# The README's main job: a short timed trace replay of Traffic on three systems, then the comparison.
demo: $(STAMP)
	$(VENV)/bin/streambox replay --workflow traffic --system streambox,stream-only,infless \
		--minutes 30 --minute-seconds 1 --scale 0.25 --out runs/demo --overwrite

burst: $(STAMP)
	$(VENV)/bin/streambox burst traffic

zoo: $(STAMP)
	$(VENV)/bin/streambox demo

test: $(STAMP)
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# For whoever has a real NVIDIA GPU (under 10 minutes): the gpu-marked tests, every zoo model's per-kernel
# times written as calibration tables beside the plans (and as JSON under $OUT when set), their error
# against the cost model, and a short Traffic replay on the CUDA backend. Without a GPU: one line, exit 0.
gpu-check: $(STAMP)
	if command -v nvidia-smi >/dev/null && ! $(VENV)/bin/python -c 'import cuda.bindings' 2>/dev/null; then \
		$(VENV)/bin/pip install --quiet -e '.[cuda]'; fi
	$(VENV)/bin/python -m streambox.gpu_check

clean-venv:
	rm -rf $(VENV)
