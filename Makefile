# shardflow: `make test` and `make demo` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch installs quickly from the local wheel cache on our machines;
# override (e.g. TORCH_SPEC="torch==2.14.1") for a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install test lint demo bench bench-ffcv docs gpu-check gpu-test dali-cuda13 clean

install: $(STAMP)

# Re-install only when the project's dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The suite in three pytest-xdist workers on our two cores (a third fills the gaps where a
# test waits on a process or a server), the long tests handed out first (conftest.py); the
# docs' pages, the Ray and the S3 tests each stay in one worker (they share a server or shards).
XDIST := -n 3 --dist loadgroup

# Then the tests marked `backend` again with nvidia.dali unimportable (an import hook:
# tests/nodali/sitecustomize.py): what they load takes the automatic backend or reader,
# the portable one there, so that it cannot rot. Tests of DALI itself skip there; the runs
# that train to an accuracy (`accuracy`) and the `slow` ones are left to the first pass.
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)
	PYTHONPATH=tests/nodali $(PY) -m pytest -q $(XDIST) -m "backend and not slow and not accuracy"

lint: $(STAMP)
	$(PY) -m ruff check pipeline trainers tools tests
	$(PY) tools/checkout.py build/checkout >/dev/null  # mypy reads the package there
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) tools/demo.py --out demo-out

# The bench extra (MosaicML Streaming, LitData: more contenders), with torch pinned so that
# it is never replaced by another build.
$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev,bench]"
	touch $(BENCH_STAMP)

# FFCV as a contender too: it compiles against the system's OpenCV and libjpeg-turbo, found
# through pkg-config, which pip cannot provide: Debian's packages first (as root), then ffcv
# (numba and opencv-python come with it). Then `make bench` measures it.
bench-ffcv: $(BENCH_STAMP)
	apt-get update
	apt-get install -y --no-install-recommends libopencv-dev libturbojpeg0-dev pkg-config
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev,bench,ffcv]"

bench: $(BENCH_STAMP)
	$(PY) tools/bench_convert.py --out bench-out
	$(PY) tools/bench_loader.py --json bench-out/loader.json --plot bench-out/loader.png
	$(PY) tools/bench_loader.py --modality text --json bench-out/text.json --plot bench-out/text.png
	$(PY) tools/bench_loader.py --modality pointcloud --json bench-out/pointcloud.json \
		--plot bench-out/pointcloud.png

# README.md (the front page, its docs/ links made relative) and docs/*.md as a site in site/
# (mkdocs.yml), with the docs extra; the Markdown reads well without it.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	rm -rf build/docs-src && mkdir -p build/docs-src
	cp -r docs/. build/docs-src/
	sed 's#](docs/#](#g' README.md > build/docs-src/index.md
	$(PY) -m mkdocs build --quiet --strict -f mkdocs.yml

# On a CUDA machine: the GPU figures (tools/gpu_check.py --help); elsewhere it says so, exits 0.
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py --json gpu-report.json

# The GPU CI job (tests/README.md): the gpu-marked tests (DALI's skip where it does not
# import), then the check, whose exit status is 1 when any part did not pass. Without CUDA
# the tests skip and the check exits 0: the target proves nothing there.
gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu
	$(PY) tools/gpu_check.py --json gpu-report.json

# A torch built for CUDA 13 (torch.version.cuda 13.x, e.g. TORCH_SPEC with a cu13 build)
# pairs with DALI's CUDA 13 wheel. Both wheels install the package nvidia.dali, so this swaps
# pyproject's nvidia-dali-cuda120 (the design card's) for it in .venv; make install does not
# undo it (to go back: pip uninstall nvidia-dali-cuda130, rm .venv/.installed, make install).
dali-cuda13: $(STAMP)
	$(PY) -m pip uninstall --yes nvidia-dali-cuda120
	$(PY) -m pip install --quiet "nvidia-dali-cuda130>=2.0"

clean:
	rm -rf demo-out bench-out .pytest_cache site build/docs-src
