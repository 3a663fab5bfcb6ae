# syntax=docker/dockerfile:1
# The slotserve gateway: OpenAI API in front of the engines, admission through Redis.
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/slotserve/gateway:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric non-root user: the chart's podSecurityContext runs as 10001 with
# runAsNonRoot, which Kubernetes can only verify for a numeric USER.
RUN groupadd --gid 10001 slotserve \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/slotserve slotserve

WORKDIR /src
# The shared core (this pyproject, slotserve/) and this image's part only.
COPY pyproject.toml constraints.txt README.md ./
COPY slotserve/ slotserve/
COPY gateway/ gateway/
RUN pip install -c constraints.txt . ./gateway \
 && cd / && rm -rf /src

WORKDIR /home/slotserve
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["slotserve"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8080"]
