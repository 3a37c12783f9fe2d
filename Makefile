# twofold: `make install`, then `make parity`.  `make help` lists every target.
# Everything runs with the Python that is active (a virtual environment's, when one is activated).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
FEATURE ?=
RECORD ?= 0
PYTEST_ARGS ?=
DEMO_ARGS ?=
FEATURES := paged_varlen_attention flash_decoding gated_deltanet view_replay_offload routed_generator decoder_lm moe weight_sync

DRY_RUN ?= 0

.PHONY: help install parity parity-all compile-check bench report demo lint roofline gpu-evidence

help:
	@echo "Targets (durations measured on a 2-core CPU machine without a GPU; parity/make_durations.py):"
	@echo "  make install        dependencies into the active Python (keeps an installed torch)        ~1 min"
	@echo "  make parity         the parity tests: every case on CUDA, else the Triton interpreter on  ~35 min"
	@echo "                      small shapes less the cases marked slow, plus the sm_90 build check,"
	@echo "                      over one pytest-xdist worker per core (PARITY_JOBS=1: one process;"
	@echo "                      measured on a 2-core Zen 1 with AVX2 only, 30-35 min from run to run;"
	@echo "                      CI's 2-core AVX2 machine took 24)"
	@echo "  make parity-all     make parity with the slow cases too (CPU; one process: ~50 min)"
	@echo "  make compile-check  ahead-of-time build of every kernel and every config (no GPU needed) ~10 min"
	@echo "  make bench          every benchmark (FEATURE=name for one); prints its tables and writes ~35 min"
	@echo "                      bench/results/latest/; RECORD=1 also appends to the committed CSVs"
	@echo "                      and regenerates bench/README.md's tables and plots"
	@echo "  make report         regenerate bench/README.md's tables and plots from the CSVs           ~1 s"
	@echo "  make roofline       bytes each kernel moves vs its IO bound, and its sm_90 build, beside  ~21 min"
	@echo "                      vLLM's and SGLang's Triton attention and MoE and fla-core (Triton"
	@echo "                      interpreter; RECORD=1 saves CSV, plot and bench/README.md's tables; the MoE"
	@echo "                      decode cases ~12 of the minutes, the prefill only with --moe-prefill: ~50)"
	@echo "  make gpu-evidence   on a lent GPU: parity (bf16 grid), the bitwise GPU tier, the kernel     <= 9.5 min"
	@echo "                      and offload benchmarks, the report; parts of <= 9 min, resumable (run"
	@echo "                      again to go on); DRY_RUN=1 lists them with their GPU budgets (43 min)    ~1 s"
	@echo "                      QUICK=1: the benchmarks' quick grids (a loan of about 15 minutes)"
	@echo "  make demo           the end-to-end RL-style loop (bench/rl_loop.py; DEMO_ARGS=--ray for a  ~40 s"
	@echo "                      Ray fleet)"
	@echo "  make lint           ruff, dead code (vulture), byte-compilation, the single-file rules     ~15 s"
	@echo "FEATURE names: $(FEATURES)"

# A PyTorch that is already installed is kept: GPU machines bring their own CUDA build.
# Where none is installed we ask for torch==2.13.0 (a CPU build on the CI machines).
# ray (2.40 .. 2.x; tested with 2.60) runs the generator fleet (fast/routed_generator.py's
# ray_generators) and its test; transformers (5.24 .. 5.x, with safetensors) is the oracle of the checkpoint
# tests (parity/test_checkpoints.py builds tiny models with it); nothing in ref/ or fast/ needs either at import.
install:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PIP) install "torch==2.13.0"; \
	fi
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install "triton>=3.4"
	$(PIP) install "einops>=0.7" "pytest>=7.4" "pytest-xdist>=3.5" "ray>=2.40,<3" "matplotlib>=3.7" "ruff>=0.6" "vulture>=2.10" \
		"transformers>=5.24,<6"

# make parity leaves out the tests marked slow (longer sweeps of what it checks on fewer cases): on a 2-core
# CPU machine 30-35 minutes on a fresh clone (a Zen 1 EPYC, AVX2 only, 2026-12-07: 1,778 to 2,103 s, the same
# tests; CI's 2-core AVX2 machine: 1,427 s); make parity-all runs everything.
# On a machine without a GPU the test files are spread over PARITY_JOBS pytest-xdist workers (default: the
# core count; the interpreter tests run mostly on one core each); PARITY_JOBS=1 runs them in one process, as a
# GPU machine does.
PARITY_JOBS ?= $(shell nproc 2>/dev/null || echo 1)
XDIST = $(shell $(PYTHON) -c "import sys, xdist, torch; sys.exit(torch.cuda.is_available() or $(PARITY_JOBS) < 2)" \
	2>/dev/null && echo "-n $(PARITY_JOBS) --dist loadfile")
parity:
	$(PYTHON) -m pytest parity -m "not slow" $(XDIST) $(PYTEST_ARGS)

parity-all:
	$(PYTHON) -m pytest parity $(XDIST) $(PYTEST_ARGS)

compile-check:
	TWOFOLD_COMPILE_ALL=1 $(PYTHON) -m pytest parity/test_compile.py $(PYTEST_ARGS)

bench:
	RECORD=$(RECORD) $(PYTHON) bench/run.py $(if $(FEATURE),--feature $(FEATURE))

report:
	$(PYTHON) bench/report.py

# The kernel observatory's report (bench/roofline.py): Triton interpreter on CPU, no GPU.  The peers it
# measures beside ours are installed for the report, never vendored: fla-core (ops only, no dependencies)
# into the active Python; vLLM's and SGLang's wheels downloaded by bench/peers.py (pip download --no-deps,
# into ~/.cache/twofold/peers) and their kernel modules loaded alone.
# RECORD=1 appends bench/results/roofline.csv, redraws roofline.png and bench/README.md's tables.
roofline:
	@$(PYTHON) -c "import sys, fla; sys.exit(fla.__version__ != '0.6.0')" 2>/dev/null || \
		$(PIP) install --no-deps "fla-core==0.6.0"
	$(PYTHON) bench/roofline.py $(if $(filter 1,$(RECORD)),--record)

demo:
	$(PYTHON) bench/rl_loop.py $(DEMO_ARGS)

# The GPU kit (bench/gpu_evidence.py): the figures owed to a GPU in parts of at most 9 minutes, resumable
# (bench/results/latest/gpu-evidence.json); DRY_RUN=1 lists the parts, their CPU-side cost and GPU budget.
gpu-evidence:
	$(PYTHON) bench/gpu_evidence.py $(if $(filter 1,$(DRY_RUN)),--dry-run) $(if $(filter 1,$(QUICK)),--quick)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m vulture ref fast parity/vulture_whitelist.py --min-confidence 60
	$(PYTHON) -m compileall -q ref fast parity bench
	$(PYTHON) -m pytest parity/test_single_file.py -q $(PYTEST_ARGS)
