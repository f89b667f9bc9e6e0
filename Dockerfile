# syntax=docker/dockerfile:1
# rankwatch images (deploy/README.md has the build commands).
#
#   agent (the default target): the node agent, without torch, which it never imports.
#   train: the training side (`rankwatch run`, the harness) on torch. Build arguments:
#     TORCH_VERSION  torch to install (default 2.13.0); empty keeps the base image's torch
#     TORCH_INDEX    where torch comes from: empty is the default index (CUDA wheels on
#                    Linux x86-64); https://download.pytorch.org/whl/cpu gives CPU-only torch
#     TRAIN_BASE     the train stage's base image, e.g. one that ships CUDA torch already
#
# Both run as uid and gid 10001: the agent's socket is mode 0600, so ranks share its uid.
ARG PYTHON_BASE=python:3.11-slim-bookworm
ARG TRAIN_BASE=${PYTHON_BASE}

FROM ${PYTHON_BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rankwatch rankwatch
COPY agent agent
COPY hooks hooks
COPY proto proto
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_BASE} AS agent
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# The wheel comes in through a bind mount, so no layer keeps a copy of it. The [otlp]
# extra lets the agent export spans when OTEL_EXPORTER_OTLP_ENDPOINT is set; [etcd] lets
# it elect a job's coordinator in etcd (--election).
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir "$(echo /wheels/rankwatch-*.whl)[otlp,etcd]" \
    && groupadd --system --gid 10001 rankwatch \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin rankwatch
# NVML needs only the driver library and device nodes that the NVIDIA container runtime
# mounts (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES=utility): no root.
USER 10001
EXPOSE 9478
ENTRYPOINT ["rankwatch", "agent"]

FROM ${TRAIN_BASE} AS train
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    if [ -n "${TORCH_VERSION}" ]; then ( \
        if [ -n "${TORCH_INDEX}" ]; then export PIP_INDEX_URL="${TORCH_INDEX}"; fi; \
        pip install --no-cache-dir "torch==${TORCH_VERSION}" ); \
    fi \
    && pip install --no-cache-dir "$(echo /wheels/rankwatch-*.whl)[etcd]" \
    && groupadd --gid 10001 rankwatch \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/rankwatch rankwatch
USER 10001
WORKDIR /home/rankwatch
ENTRYPOINT ["rankwatch", "run"]

FROM agent
