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
# /creds and /bus-auth: mount points of compose.yml's credential volumes. A fresh
# named volume takes the owner and mode of the image's directory, so the one-shot
# `jetserve credentials` (uid 10001) can write there and every jetserve
# container (same uid) can read its 0600 files; /bus-auth holds only the servers'
# public files (readable by nats-server and redis-server, which run as other users).
RUN pip install . \
    && rm -rf /src \
    && useradd --create-home --uid 10001 --user-group jetserve \
    && install -d -o 10001 -g 10001 -m 0700 /creds \
    && install -d -o 10001 -g 10001 -m 0755 /bus-auth

USER 10001:10001
WORKDIR /home/jetserve

# 8080: gateway (HTTP/SSE/WebSocket); 8100: engine simulator.
EXPOSE 8080 8100
ENTRYPOINT ["jetserve"]
CMD ["--help"]
