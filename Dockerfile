# One image for every jetserve process: `jetserve gateway|worker|sim|keys ...`.
# NATS and Redis run from their official images (see compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package build needs (README.md: pyproject's `readme`).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY streams/ streams/
COPY gateway/ gateway/
COPY workers/ workers/
COPY tools/ tools/
COPY jetserve/ jetserve/
RUN pip install . \
    && rm -rf /src \
    && useradd --create-home --uid 10001 --user-group jetserve

USER 10001:10001
WORKDIR /home/jetserve

# 8080: gateway (HTTP/SSE/WebSocket); 8100: engine simulator.
EXPOSE 8080 8100
ENTRYPOINT ["jetserve"]
CMD ["--help"]
