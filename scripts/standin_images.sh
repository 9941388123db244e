#!/usr/bin/env bash
# Stand-in base images for hosts that cannot pull from a container registry: builds, with mmdebstrap
# (Debian bookworm), the two images the Dockerfile and docker-compose.yml name, and tags them with those
# names so `compose build` and `compose up` run unmodified:
#
#   python:3.11-slim  Debian's python3 (3.11) with venv, its headers and `python`, the host's CA bundle, a pip config
#                     (the host's index and, with STANDIN_WHEELS, a folder of wheels as find-links)
#   postgres:17       Debian's PostgreSQL (15 in bookworm) behind an entrypoint that honours the official
#                     image's POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB and PGDATA
#
# Usage (as root, podman or docker installed; see docs/deploy.md, "Smoke test"):
#   bash scripts/standin_images.sh                       # both images, with podman
#   bash scripts/standin_images.sh python                # one of them (python or postgres)
#   ENGINE=docker bash scripts/standin_images.sh
#   STANDIN_WHEELS=/opt/wheels bash scripts/standin_images.sh   # e.g. a CPU torch wheel
#
# Variables: ENGINE (podman|docker, default podman), MIRROR (Debian mirror, default deb.debian.org),
# STANDIN_WHEELS (folder of wheels copied to /opt/wheels in the python image; default: the host pip
# config's find-links folder, if any), CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt),
# PYTHON_TAG / POSTGRES_TAG (default python:3.11-slim / postgres:17).
set -euo pipefail

ENGINE=${ENGINE:-podman}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
PYTHON_TAG=${PYTHON_TAG:-python:3.11-slim}
POSTGRES_TAG=${POSTGRES_TAG:-postgres:17}
command -v mmdebstrap >/dev/null || { echo "needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
command -v "$ENGINE" >/dev/null || { echo "needs $ENGINE" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- the host's pip settings, as the image will see them --------------------------------------
index_url=${PIP_INDEX_URL:-$(pip config get global.index-url 2>/dev/null || true)}
if [ -z "${STANDIN_WHEELS:-}" ]; then
    for links in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
        [ -d "$links" ] && STANDIN_WHEELS=$links && break
    done
fi
mkdir -p "$work/wheels"
if [ -n "${STANDIN_WHEELS:-}" ]; then
    # only what a build of this image can use: CPython 3.11 or pure-Python wheels
    find "$STANDIN_WHEELS" -maxdepth 1 \( -name '*-cp311-*.whl' -o -name '*-py3-none-any.whl' \) \
        -exec cp {} "$work/wheels/" \;
fi
{
    echo "[global]"
    echo "cert = /etc/ssl/certs/ca-certificates.crt"
    [ -n "$index_url" ] && echo "index-url = $index_url"
    echo "find-links = /opt/wheels"
} > "$work/pip.conf"
cp "$CA_BUNDLE" "$work/ca-certificates.crt"

targets=" ${*:-python postgres} "

# --- python:3.11-slim -----------------------------------------------------------------------
# python3-dev: the official image carries Python.h, which the compiled token passes need.
if [[ $targets == *" python "* ]]; then
mmdebstrap --variant=minbase --include=python3,python3-dev,python3-venv,python-is-python3,ca-certificates \
    --customize-hook="mkdir -p \"\$1/opt/wheels\" && cp $work/wheels/. -r \"\$1/opt/wheels/\"" \
    --customize-hook="cp $work/pip.conf \"\$1/etc/pip.conf\"" \
    --customize-hook="cp $work/ca-certificates.crt \"\$1/etc/ssl/certs/ca-certificates.crt\"" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$work/python.tar" "$MIRROR"
"$ENGINE" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$work/python.tar" "$PYTHON_TAG"
rm -f "$work/python.tar"
echo "stand-in tagged: $PYTHON_TAG ($ENGINE image)"
fi

# --- postgres:17 ------------------------------------------------------------------------------
# Debian's package creates a cluster (on the next free port: 5433 when the host runs PostgreSQL),
# which psql and pg_isready would then look for: it is dropped, as the official image has none.
if [[ $targets == *" postgres "* ]]; then
cat > "$work/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# Stand-in for the official postgres image's entrypoint: initialise PGDATA once from POSTGRES_USER,
# POSTGRES_PASSWORD and POSTGRES_DB, then run the server in the foreground as user postgres.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
export PATH="$bin:$PATH" PGDATA="${PGDATA:-/var/lib/postgresql/data}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ "${1:-postgres}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp) && printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" > "$pwfile"
    chown postgres "$pwfile"
    runuser -u postgres -- initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    if [ "$db" != postgres ]; then
        runuser -u postgres -- pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        runuser -u postgres -- psql -U "$user" -d postgres -qc "CREATE DATABASE \"$db\""
        runuser -u postgres -- pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
fi
[ "${1:-postgres}" = postgres ] && exec runuser -u postgres -- postgres -D "$PGDATA"
exec "$@"
EOF
chmod 755 "$work/docker-entrypoint.sh"
mmdebstrap --variant=minbase --include=postgresql,ca-certificates \
    --customize-hook="cp $work/docker-entrypoint.sh \"\$1/usr/local/bin/docker-entrypoint.sh\"" \
    --customize-hook='chroot "$1" sh -c "pg_lsclusters -h | while read v c rest; do pg_dropcluster \$v \$c; done"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$work/postgres.tar" "$MIRROR"
"$ENGINE" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PGDATA=/var/lib/postgresql/data' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
    --change 'CMD ["postgres"]' \
    --change 'EXPOSE 5432' \
    "$work/postgres.tar" "$POSTGRES_TAG"
echo "stand-in tagged: $POSTGRES_TAG ($ENGINE image)"
fi
