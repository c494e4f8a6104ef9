# Two commands on a fresh machine:  `make run` (train on the embedded default)  and  `make test`.
# Both create .venv and install everything they need. On a CPU-only machine torch $(TORCH_VERSION)
# (CPU build) is installed first, so the packages' torch range installs nothing more; with a CUDA
# machine, install the torch build you want into .venv first (or set TORCH_SPEC).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every distribution of the workspace, lowest layer first (see pyproject.toml).
PARTS := libs/core libs/fragments libs/protocol libs/algorithm libs/simulator libs/training \
         services/synchronizer services/learner lab
PYPROJECTS := pyproject.toml $(addsuffix /pyproject.toml,$(PARTS))

.PHONY: install run test test-fast lint bench protos clean

$(STAMP): $(PYPROJECTS) scripts/third_party_requirements.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet "setuptools>=69" wheel "uv>=0.5"
	# uv resolves and installs the rest (about 25 s where pip took 2 min) and keeps the torch above:
	# every third-party requirement first, then the workspace's packages, editable, without
	# dependencies. In one go, a package's build could run while a setuptools plugin of another
	# (kernels, via transformers) was installed and what it imports was not yet, and fail
	# (scripts/third_party_requirements.py says more).
	# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set, nothing else would ever write the
	# bytecode, and every process would compile its imports again. compat: each folder goes on
	# sys.path as it is, so tools that read files (lint-imports, mypy) see the namespace packages
	# exactly as Python imports them
	$(BIN)/python scripts/third_party_requirements.py . $(PARTS) --extra dev > $(VENV)/third-party.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode -r $(VENV)/third-party.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode --no-build-isolation --no-deps \
		--config-setting editable_mode=compat $(addprefix -e ,$(PARTS)) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/ddiloco run $(ARGS)

# TEST_WORKERS=N: N pytest-xdist workers (0: one process, the default). The container tests, which
# share one Docker engine, go to one worker together (tests/conftest.py); their engine's gigabytes
# of image layers are removed only when the whole session has ended, never beside a running test.
# On a shared 2-core machine two workers took 28-33 minutes where one process took 38, but the chaos tests'
# timing bounds then share the CPU with image builds (one exceeded its slack by 2 ms): opt-in.
TEST_WORKERS ?= 0
test: $(STAMP)
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) $(PYTEST_ARGS)

# The edit-test loop: what runs in one process (no e2e or system tests; tests/conftest.py says which).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e and not system" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy libs/fragments/ddiloco libs/algorithm/ddiloco libs/core/ddiloco libs/training/ddiloco lab/ddiloco

bench: $(STAMP)
	$(BIN)/ddiloco bench codec
	$(BIN)/ddiloco bench merge

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
