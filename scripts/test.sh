#!/usr/bin/env bash
# The whole test suite on a fresh machine: environment, services, lint, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/services.sh
export RLVITALS_TEST_PG_URL=${RLVITALS_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
