# The README's two commands, on a fresh clone with only Python >= 3.10 present:
#
#   make bench   # the main job: freezeframe bench --preset tiny
#   make test    # the tests: pytest -q -n auto --dist loadfile (one worker per core, each file on one)
#   make fuzz    # the full differential matrix (tests/matrix with FF_MATRIX=full): slow
#
# The first use creates a virtualenv in .venv, puts torch in it (scripts/install_torch.sh: a CPU
# build where there is no GPU; a torch already in the venv is kept) and installs this checkout
# into it, editable, with the extras below. A stamp file records that install: later runs go
# straight to the command, and pip runs again only when pyproject.toml (or this file, or the
# torch script) is newer than the stamp.
#
# Knobs: PYTHON=python3.12 (the interpreter that creates the venv), VENV=path,
# TESTS='tests/unit/test_cli.py' PYTEST_ARGS='-q -x' (what pytest runs), BENCH_ARGS='--preset tiny',
# FUZZ_SEEDS=400 (how many seeds make fuzz runs; FF_MATRIX_START=N starts elsewhere), FUZZ_ARGS.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,bench,hf
TESTS ?=
PYTEST_ARGS ?= -q -n auto --dist loadfile
BENCH_ARGS ?= --preset tiny
FUZZ_SEEDS ?= 400
# the full tier's seeds are independent (its floor test is the fast slice's): any worker takes any
FUZZ_ARGS ?= -q -n auto --dist load

VENV_BIN := $(abspath $(VENV))/bin
VPY := $(VENV_BIN)/python
STAMP := $(VENV)/.freezeframe-installed
# The venv's bin first on PATH, as an activated venv would have it (for anything run by name).
IN_VENV := PATH="$(VENV_BIN):$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.DEFAULT_GOAL := help
.PHONY: help bench test fuzz check-wheel venv clean-venv

help:
	@echo "make bench        the main job: freezeframe bench $(BENCH_ARGS) (results in bench_out/)"
	@echo "make test         the tests (pytest $(PYTEST_ARGS) $(TESTS))"
	@echo "make fuzz         the full differential matrix: $(FUZZ_SEEDS) seeds, Inductor and HF too"
	@echo "make check-wheel  build the wheel, install it in a clean venv, run the demo from it"
	@echo "make venv         only the set-up: $(VENV) with torch and freezeframe[$(EXTRAS)]"
	@echo "make clean-venv   remove $(VENV)"

bench: $(STAMP)
	$(IN_VENV) freezeframe bench $(BENCH_ARGS)

# pytest's exit status 5 means it collected no test: the suite went missing, a failure here.
test: $(STAMP)
	@$(IN_VENV) $(VPY) -m pytest $(PYTEST_ARGS) $(TESTS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

# The differential matrix's full tier (tests/matrix/test_matrix.py): the fast slice runs in
# make test; this adds Inductor, the Hugging Face models and warm starts in a fresh process.
fuzz: $(STAMP)
	$(IN_VENV) FF_MATRIX=full FF_MATRIX_SEEDS=$(FUZZ_SEEDS) $(VPY) -m pytest $(FUZZ_ARGS) \
	    tests/matrix

# Uses the venv's interpreter to build and as the base of the clean venv it installs into.
check-wheel: $(STAMP)
	PYTHON="$(VPY)" bash scripts/check_wheel.sh

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/install_torch.sh
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else \
	"freezeframe needs Python >= 3.10; $(PYTHON) is " + sys.version.split()[0] + \
	": run make with PYTHON=python3.X naming a newer one")'
	@if ! "$(VPY)" -c '' 2>/dev/null; then \
	    echo "make: creating the virtualenv $(VENV) with $(PYTHON)"; rm -rf "$(VENV)"; \
	    $(PYTHON) -m venv "$(VENV)" || { echo "make: '$(PYTHON) -m venv' failed; on \
	Debian/Ubuntu install the python3-venv package" >&2; exit 1; }; fi
	bash scripts/install_torch.sh "$(VPY)"
	"$(VPY)" -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	@touch "$@"

clean-venv:
	rm -rf "$(VENV)"
