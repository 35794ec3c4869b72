# shardflow: `make test` and `make demo` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch installs quickly from the local wheel cache on our machines;
# override (e.g. TORCH_SPEC="torch==2.14.1") for a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench gpu-check clean

install: $(STAMP)

# Re-install only when the project's dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check pipeline trainers tools tests
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) tools/demo.py --out demo-out

bench: $(STAMP)
	$(PY) tools/bench_convert.py --out bench-out
	$(PY) tools/bench_loader.py --json bench-out/loader.json --plot bench-out/loader.png
	$(PY) tools/bench_loader.py --modality text --json bench-out/text.json --plot bench-out/text.png
	$(PY) tools/bench_loader.py --modality pointcloud --json bench-out/pointcloud.json \
		--plot bench-out/pointcloud.png

# On a CUDA machine: the gpu-marked tests and the GPU figures; elsewhere it says so, exits 0.
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py --json gpu-report.json

clean:
	rm -rf demo-out bench-out .pytest_cache
