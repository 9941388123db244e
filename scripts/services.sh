#!/usr/bin/env bash
# Bring up what the test suite needs on a plain Debian machine, assuming nothing from the image:
#   - PostgreSQL on 127.0.0.1:5432 with trust auth for loopback, a passwordless `postgres` role and a
#     `test` database (tests/conftest.py creates and drops its own databases from there);
#   - Debian's chromium (the dashboard's browser tests drive /usr/bin/chromium through playwright).
# Each step is skipped when already true, so a second run is quick. Installing needs root (apt-get);
# without root the script says what is missing and exits 1 instead of letting every PostgreSQL test fail.
#
#   RLVITALS_SERVICES_DRY_RUN=1 bash scripts/services.sh   # print what would be run, change nothing
set -euo pipefail

PGPORT=${RLVITALS_PG_PORT:-5432}       # another port + cluster name let a test exercise every branch
CLUSTER=${RLVITALS_PG_CLUSTER:-main}   # without touching the machine's own server
DRY=${RLVITALS_SERVICES_DRY_RUN:-}
say() { echo "services: $*" >&2; }
run() {  # run as root, or say what is needed
  if [ -n "$DRY" ]; then say "would run: $*"; return 0; fi
  if [ "$(id -u)" = 0 ]; then "$@"; else say "needs root: $*"; exit 1; fi
}
apt_install() {
  run env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq
  run env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "$@"
}
pg_ok() { psql -w -h 127.0.0.1 -p "$PGPORT" -U postgres -d "${1:-postgres}" -Atqc 'select 1' >/dev/null 2>&1; }

# --- PostgreSQL ----------------------------------------------------------------------------------
if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
  say "PostgreSQL is not installed: installing Debian's postgresql"
  apt_install postgresql
fi
version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)
version=${version:-15}
if ! pg_isready -h 127.0.0.1 -p "$PGPORT" -q 2>/dev/null; then
  if [ ! -d "/etc/postgresql/$version/$CLUSTER" ]; then
    say "creating cluster $version/$CLUSTER"
    run pg_createcluster --port "$PGPORT" "$version" "$CLUSTER"
  fi
  say "starting PostgreSQL $version/$CLUSTER"
  run pg_ctlcluster --skip-systemctl-redirect "$version" "$CLUSTER" start || true  # "already running" is fine
  for _ in $(seq 1 30); do
    [ -n "$DRY" ] && break
    pg_isready -h 127.0.0.1 -p "$PGPORT" -q && break
    sleep 1
  done
fi
if [ -z "$DRY" ] && ! pg_isready -h 127.0.0.1 -p "$PGPORT" -q; then
  say "PostgreSQL did not come up on 127.0.0.1:$PGPORT (see /var/log/postgresql/)"
  exit 1
fi
if ! pg_ok; then
  # Debian's default pg_hba.conf asks loopback TCP for a password; the test role has none.
  hba="/etc/postgresql/$version/$CLUSTER/pg_hba.conf"
  say "trusting 127.0.0.1 in $hba (test machines only)"
  if [ -z "$DRY" ]; then
    [ "$(id -u)" = 0 ] || { say "needs root to edit $hba"; exit 1; }
    grep -q '^host all all 127.0.0.1/32 trust' "$hba" || sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
  fi
  run pg_ctlcluster --skip-systemctl-redirect "$version" "$CLUSTER" reload
  [ -n "$DRY" ] || pg_ok || { say "still cannot connect as postgres@127.0.0.1 without a password"; exit 1; }
fi
if ! pg_ok test; then
  say "creating database test"
  [ -n "$DRY" ] || psql -w -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -qc 'CREATE DATABASE test'
fi

# --- Chromium ------------------------------------------------------------------------------------
if [ ! -x /usr/bin/chromium ]; then
  say "chromium is not installed: installing Debian's chromium"
  apt_install chromium
fi
