# twofold: `make install`, then `make parity`.  `make help` lists every target.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
FEATURE ?=
PYTEST_ARGS ?=

.PHONY: help install parity compile-check bench report demo lint roofline

help:
	@echo "make install        install the dependencies into $(PYTHON) (keeps an installed torch)"
	@echo "make parity         all parity tests: full grid on CUDA, else the Triton interpreter on small shapes"
	@echo "make compile-check  ahead-of-time build of every Triton kernel and config for sm_80 and sm_90 (no GPU needed)"
	@echo "make bench          every benchmark (FEATURE=name for one), then regenerate the README tables"
	@echo "make report         regenerate the README tables from bench/results/*.csv"
	@echo "make roofline       bytes each kernel moves vs its IO bound, and its sm_90 build, beside fla-core 0.6.0 (CPU; RECORD=1 saves)"
	@echo "make demo           the end-to-end RL-style loop (bench/rl_loop.py)"
	@echo "make lint           byte-compile everything and check the single-file house rules"

# A PyTorch that is already installed is kept: GPU machines bring their own CUDA build.
# Where none is installed we ask for torch==2.13.0 (a CPU build on the CI machines).
install:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PIP) install "torch==2.13.0"; \
	fi
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install "triton>=3.4"
	$(PIP) install "einops>=0.7" "numpy>=1.24" "pytest>=7.4" "pytest-benchmark>=4.0"

# Everything under parity/, the ahead-of-time compile check included.
parity:
	$(PYTHON) -m pytest parity $(PYTEST_ARGS)

compile-check:
	TWOFOLD_COMPILE_ALL=1 $(PYTHON) -m pytest parity/test_compile.py $(PYTEST_ARGS)

bench:
	$(PYTHON) bench/run.py $(if $(FEATURE),--feature $(FEATURE))

report:
	$(PYTHON) bench/report.py

# The kernel observatory's report (bench/roofline.py): Triton interpreter on CPU, no GPU.  fla-core is
# the peer it measures beside ours: installed for the report (ops only, no dependencies), never vendored.
# RECORD=1 appends bench/results/roofline.csv, redraws roofline.png and the README's tables.
roofline:
	@$(PYTHON) -c "import sys, fla; sys.exit(fla.__version__ != '0.6.0')" 2>/dev/null || \
		$(PIP) install --no-deps "fla-core==0.6.0"
	$(PYTHON) bench/roofline.py $(if $(RECORD),--record)

demo:
	$(PYTHON) bench/rl_loop.py

lint:
	$(PYTHON) -m compileall -q ref fast parity bench
	$(PYTHON) -m pytest parity/test_single_file.py $(PYTEST_ARGS)
