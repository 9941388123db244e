# rlvitals server image: CPU-only torch (the audits need no GPU), the server extra, a non-root user.
#
#   docker build -t rlvitals .
#   docker run -p 127.0.0.1:8000:8000 -v rlvitals-data:/var/lib/rlvitals rlvitals serve --host 0.0.0.0 --insecure
#
# The image's entrypoint is the `rlvitals` command; its default command serves on 0.0.0.0:8000 with the
# embedded SQLite database in the /var/lib/rlvitals volume. docker-compose.yml runs it on PostgreSQL.
# The server refuses a non-loopback address while no API key exists: create one first
# (`rlvitals keys create`, see docs/deploy.md) or pass --insecure on a trusted network.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a C compiler for the audit's compiled token passes (analyzers/csrc); the runtime image needs none
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/rlvitals
ENV PATH=/opt/rlvitals/bin:$PATH
# CPU torch first: an unpinned torch would pull a multi-GB CUDA build. TORCH_INDEX_URL names another
# index that serves it (with its dependencies), e.g. a mirror; docker-compose.yml passes it through.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
COPY analyzers ./analyzers
COPY client ./client
COPY service ./service
# setup.py maps rlvitals.examples to examples/ (`rlvitals demo` runs the tiny trainer from the wheel).
COPY examples ./examples
RUN pip install ".[server]" && rlvitals --help >/dev/null \
    && python -c "from rlvitals.analyzers.fast import native; assert native.module(), native.STATUS"

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/rlvitals --create-home rlvitals
COPY --from=build /opt/rlvitals /opt/rlvitals
ENV PATH=/opt/rlvitals/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RLVITALS_DATA_DIR=/var/lib/rlvitals
USER rlvitals
WORKDIR /var/lib/rlvitals
VOLUME ["/var/lib/rlvitals"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=5 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["rlvitals"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
