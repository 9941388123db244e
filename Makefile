.PHONY: run test test-fast bench lint docs docs-build
FAST_MARKERS = not sideenv and not browser and not docker and not slow and not heavy
# the edit-test loop's smaller budgets: a quarter of each fuzzer's examples (tests/support/budget.py) and a
# 5 s closed-port outage instead of 30 (tests/client/test_client_faults.py); `make test` keeps the full ones
FAST_ENV = RLVITALS_TEST_EXAMPLES=0.25 RLVITALS_FAULT_OUTAGE_S=5
run:  ## run the product: demo trainers against a server on embedded SQLite (installs the server extra only)
	@RLVITALS_EXTRAS=server bash scripts/bootstrap.sh && .venv/bin/rlvitals demo
test:  ## the whole test suite, from a fresh machine (about 40 minutes; CI runs this)
	@bash scripts/test.sh
test-fast:  ## the edit-test loop: lint, docs, every test but side environments, Chromium, Docker, packaging and heavy real-process ones; smaller fuzz budgets; a worker per core
	@$(FAST_ENV) RLVITALS_TEST_MARKERS="$(FAST_MARKERS)" bash scripts/test.sh -n auto $(ARGS)
lint:  ## ruff, the layers of analyzers/ (lint-imports), and the documentation site built strictly
	@.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/lint-imports --no-cache && $(MAKE) --no-print-directory docs-build
docs-build:
	@NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
docs:  ## serve the documentation site at http://127.0.0.1:8001
	@NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8001
