# Two commands on a fresh machine: `make demo` (main job) and `make test` (the fast tier of the suite; `make
# test-all` the whole suite).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
OUT    ?= runs/demo

.PHONY: demo test test-long test-all bench env clean docs docs-serve

env: $(VENV)/.installed

$(VENV)/.installed: requirements/ci.txt requirements/docs.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/ci.txt -r requirements/docs.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . || $(PY) -m pip install --quiet --no-deps -e .
	touch $@

# The synthetic rank-recovery experiment ([PF2LoRA] §5): PF2LoRA vs HetLoRA, 5 seeds,
# once with our tuned step sizes on the shared+private ground truth, once as the paper wrote it.
demo: env
	$(VENV)/bin/fedlora synthetic rank-recovery --preset tuned --ground-truth shared-private --seeds 5 --out $(OUT)/tuned-shared-private
	$(VENV)/bin/fedlora synthetic rank-recovery --preset paper --ground-truth independent --seeds 5 --out $(OUT)/paper-independent

# pytest's own script, not `python -m pytest`: that would put the repo root first on sys.path, where the
# folder kernels/ (installed as fedlora.kernels) would shadow HuggingFace's `kernels` (issue 18 §2).
# The suite is spread over the machine's cores (pytest-xdist: one pytest process per core; tests that share
# an expensive fixture carry one xdist_group and run in one process); TEST_WORKERS=0 runs it in this process.
# --no-loadscope-reorder: tests are handed out in the suite's order (tests/_xdist_order.py), not the groups with
# the most tests first. Measured on a 2-core machine: 2 workers 541 s, 3 workers 597 s.
# Two tiers (issue 26), each call's summary line stating its time:
#   make test       every test but the long end-to-end ones: the feedback loop while you work;
#   make test-long  the tests marked `long` (pyproject.toml): Flower deployments and Ray simulations, the real
#                   MiniLM, the sm_90 compile, the docs builds, the wheel, subprocess signal and start-up probes;
#   make test-all   both, one after the other: what CI runs (.ci/run).
TEST_WORKERS ?= logical
PYTEST_XDIST := -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=20
test: env
	$(VENV)/bin/pytest $(PYTEST_XDIST) -m "not long"
	@echo "make test: the fast tier; \`make test-long\` runs the long end-to-end tier, \`make test-all\` both (CI)"

test-long: env
	$(VENV)/bin/pytest $(PYTEST_XDIST) -m long

test-all: test test-long

# The documentation site (mkdocs.yml): strict, so a broken link, a missing anchor or a docstring warning fails
# the build; into build/site. NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0 (not a build warning).
docs: env
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# A live preview at http://127.0.0.1:8000 (rebuilds on every change; DOCS_ADDR=0.0.0.0:8000 to serve others)
DOCS_ADDR ?= 127.0.0.1:8000
docs-serve: env
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict --dev-addr $(DOCS_ADDR)

bench: env
	$(VENV)/bin/pytest -q bench/ --benchmark-only

clean:
	rm -rf $(VENV) runs build/site build/docs-api
