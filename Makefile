.PHONY: run test bench lint
run:  ## run the product: demo trainers against a server on embedded SQLite (installs the server extra only)
	@RLVITALS_EXTRAS=server bash scripts/bootstrap.sh && .venv/bin/rlvitals demo
test:  ## the whole test suite, from a fresh machine
	@bash scripts/test.sh
lint:
	@.venv/bin/ruff check . && .venv/bin/ruff format --check .
