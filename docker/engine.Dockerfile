# syntax=docker/dockerfile:1
# The slotserve engine: one model server process (continuous batching on PyTorch).
#   docker build -f docker/engine.Dockerfile -t ghcr.io/slotserve/engine:0.1.0 .
# The default torch wheel from PyPI is the CUDA build (GPU nodes); for a smaller CPU-only image:
#   docker build -f docker/engine.Dockerfile \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t slotserve-engine:cpu .
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
# 1 = bake SmolLM2-135M-Instruct into the image (pools with `source: {builtin: smollm2}`).
ARG BAKE_SMOLLM2=1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLOTSERVE_HOME=/opt/slotserve

# The operator runs engine pods as uid 1000 with runAsNonRoot and a read-only root filesystem
# (HOME, caches and /tmp are volumes it mounts).
RUN groupadd --gid 1000 slotserve \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/slotserve slotserve

# torch first, from the chosen index; then the engine extra with the other pins. The repo's
# constraints pin the CPU wheel (torch==...+cpu) used in development, so that line is dropped.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
# The shared core (this pyproject, slotserve/) and this image's part only.
COPY pyproject.toml constraints.txt README.md ./
COPY slotserve/ slotserve/
COPY engine/ engine/
RUN grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
 && pip install -c /tmp/constraints.txt . ./engine \
 && cd / && rm -rf /src /tmp/constraints.txt

# The native kernels (engine/.../core/kernels/*.c), compiled now into the package's read-only
# prebuilt/ folder with the sha256 of the library beside it: engines load them from there after
# checking that hash, before any cache, so pods need no compiler and run none. gcc leaves the
# image in this same layer (libgomp1 stays: the library links it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && python -m slotserve.engine.core.kernels --prebuilt \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Weights stay read-only at run time under SLOTSERVE_HOME.
RUN mkdir -p /opt/slotserve \
 && if [ "${BAKE_SMOLLM2}" = "1" ]; then slotserve model pull smollm2 --quiet; fi \
 && chmod -R a+rX /opt/slotserve

WORKDIR /home/slotserve
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["slotserve"]
CMD ["engine", "--model", "smollm2", "--port", "8000"]
