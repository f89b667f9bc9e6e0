# rankwatch images.
#   agent (default): the node agent, no torch:   docker build -t rankwatch-agent .
#   train: the harness on a torch base:          docker build --target train \
#            --build-arg TORCH_BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime -t rankwatch-train .
ARG PYTHON_BASE=python:3.11-slim
ARG TORCH_BASE=python:3.11-slim

FROM ${PYTHON_BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rankwatch rankwatch
COPY agent agent
COPY hooks hooks
COPY proto proto
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_BASE} AS agent
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home rankwatch
# NVML needs the driver's libnvidia-ml, mounted by the NVIDIA container runtime; no root needed.
USER 10001
EXPOSE 9478
ENTRYPOINT ["rankwatch", "agent"]

FROM ${TORCH_BASE} AS train
ARG TORCH_SPEC="torch>=2.8,<2.14"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "${TORCH_SPEC}" /wheels/*.whl && rm -rf /wheels
ENTRYPOINT ["rankwatch", "run"]

FROM agent
