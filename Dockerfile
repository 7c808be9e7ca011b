# Fleet Gateway: one small image, one uvicorn worker per container (scale with replicas).
# Mount the routing table at /etc/fleet-gateway/routes.yaml.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=18000 \
    GATEWAY_ROUTES=/etc/fleet-gateway/routes.yaml
USER gateway
EXPOSE 18000
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('GATEWAY_PORT', '18000'), timeout=2)"]
ENTRYPOINT ["fleet-gateway"]
CMD ["serve"]
