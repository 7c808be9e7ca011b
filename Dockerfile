# Fleet Gateway: one small image, one uvicorn worker per container (scale with replicas, not
# workers: each process keeps its own replica health and in-flight counts).
# Mount the routing table at /etc/fleet-gateway/routes.yaml; pass keys as GATEWAY_API_KEYS.
#   docker build -t fleet-gateway .
#   docker run -p 18000:18000 -v ./routes.yaml:/etc/fleet-gateway/routes.yaml:ro fleet-gateway
# tests/test_deploy.py runs this file's install steps and its HEALTHCHECK outside Docker.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# 1 (the default) compiles the request path with mypyc (setup.py names the modules): a request
# runs about a third fewer instructions in the gateway. 0 builds pure Python, as in development.
ARG GATEWAY_COMPILE=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
# A wheel, built here with the compiler when compiling, installed (not editable) into a venv that the
# runtime stage copies whole: no compiler, no mypy, no pip cache and no source tree in the final
# image. The compiler comes from the build stage's own packages; nothing here lasts.
# hadolint ignore=DL3008
RUN if [ "$GATEWAY_COMPILE" = 1 ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/* \
        && python -m pip install "setuptools>=77" "mypy>=1.13" \
        && GATEWAY_COMPILE=1 python -m pip wheel --no-build-isolation --no-deps --wheel-dir wheels . ; \
    else \
        python -m pip wheel --no-deps --wheel-dir wheels . ; \
    fi \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install wheels/*.whl \
    && /opt/venv/bin/fleet-gateway --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="fleet-gateway" \
      org.opencontainers.image.description="One OpenAI-compatible endpoint in front of vLLM and llama.cpp replicas" \
      org.opencontainers.image.licenses="Apache-2.0"
# A numeric UID, so Kubernetes' runAsNonRoot can verify it (it refuses a user name it cannot resolve).
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --no-log-init \
       --home-dir /nonexistent --shell /usr/sbin/nologin gateway \
    && mkdir -p /etc/fleet-gateway
COPY --from=build /opt/venv /opt/venv
# The venv's .pyc files were written at install time, so a read-only root filesystem costs nothing.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=18000 \
    GATEWAY_ROUTES=/etc/fleet-gateway/routes.yaml
USER 10001:10001
EXPOSE 18000
# /health is public (no API key) and only says the process serves; /ready is for load balancers.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('GATEWAY_PORT', '18000'), timeout=2)"]
# SIGTERM drains for GATEWAY_DRAIN_SECONDS (30 s): give `docker stop -t` / stop_grace_period more.
# SIGHUP reloads routes.yaml (`docker kill -s HUP <container>`).
STOPSIGNAL SIGTERM
ENTRYPOINT ["fleet-gateway"]
CMD ["serve"]
