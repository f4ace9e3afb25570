# The gateway's container image. Build from the repository root:
#   docker build -t llm-gateway:0.1.0 .
# It reads its config from /etc/gateway/gateway.yaml (the Helm chart mounts a ConfigMap there)
# and writes only under /tmp (the usage spool), so it runs with a read-only root filesystem.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    TMPDIR=/tmp

# A fixed, numeric, non-root identity (Kubernetes' runAsNonRoot can only verify numeric users).
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin gateway

WORKDIR /src
# The repository minus .dockerignore (tests, helm, caches, .venv...). Note gateway/configs is a
# symlink to config/, so both must be in the context.
COPY . .
RUN pip install --no-cache-dir . \
    && rm -rf /src

WORKDIR /
USER 10001:10001
EXPOSE 8000

# Liveness only (readiness, which needs Redis, is the orchestrator's business: GET /readyz).
# The slim image has no curl: python's urllib raises on anything but a 2xx answer.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=3)"]

ENTRYPOINT ["gateway"]
CMD ["serve", "--config", "/etc/gateway/gateway.yaml"]
