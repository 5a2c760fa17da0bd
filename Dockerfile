# gpufootprint daemon image: docker build -t gpufootprint/gpufootprint:0.1.0 .
# Runs as an unprivileged user with no added capabilities; NVML comes from the
# driver the NVIDIA container toolkit mounts (NVIDIA_DRIVER_CAPABILITIES=utility).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
# Unpinned apt packages: the base image's archive only carries the current, patched
# python3 for this release, and an old pin would fail to resolve after an update.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY daemon/ daemon/
# Dependencies are pinned in pyproject.toml.
RUN python3 -m venv /opt/gpufootprint \
 && /opt/gpufootprint/bin/pip install --no-cache-dir /src

FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="gpufootprint" \
      org.opencontainers.image.description="CUPTI-driven runtime GPU memory-footprint daemon with Prometheus metrics" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 gpufootprint \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin gpufootprint \
 && install -d -o 10001 -g 10001 -m 0755 /run/gpufootprint
COPY --from=build /opt/gpufootprint /opt/gpufootprint
ENV PATH=/opt/gpufootprint/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 9878
HEALTHCHECK --interval=30s --timeout=3s CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9878/healthz', timeout=2)"]
ENTRYPOINT ["gpufootprint"]
CMD ["daemon", "--listen", "0.0.0.0:9878"]
