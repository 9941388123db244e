#!/usr/bin/env bash
# The whole test suite on a fresh machine: environment, services, lint, the documentation site, tests.
# RLVITALS_TEST_MARKERS (a pytest -m expression) narrows the tests: `make test-fast` sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/services.sh
export RLVITALS_TEST_PG_URL=${RLVITALS_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the layers of analyzers/ and what it may never import ([tool.importlinter] in pyproject.toml)
.venv/bin/lint-imports --no-cache
# broken links, missing anchors and pages left out of the site fail here (mkdocs.yml: strict)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
if [ -n "${RLVITALS_TEST_MARKERS:-}" ]; then
  exec .venv/bin/python -m pytest -m "$RLVITALS_TEST_MARKERS" "$@"
fi
exec .venv/bin/python -m pytest "$@"
