# gpufootprint daemon image: docker build -t gpufootprint/gpufootprint:0.1.0 .
# Runs as an unprivileged user with no added capabilities; NVML comes from the
# driver the NVIDIA container toolkit mounts (NVIDIA_DRIVER_CAPABILITIES=utility).
# The daemon needs no CUPTI (only the probe inside workloads does): the image installs
# the daemon extra, at the versions of constraints.txt.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
# Unpinned apt packages: the base image's archive only carries the current, patched
# python3 for this release, and an old pin would fail to resolve after an update.
# gcc and libc6-dev build the daemon's C core (libgfp-core.so) in this stage only: the final stage copies
# the venv with the built library and has no compiler.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependency layer: rebuilt only when the dependencies or their tested versions change,
# not at every code change. The list is read from pyproject.toml (base + the daemon extra).
COPY pyproject.toml constraints.txt ./
RUN python3 -m venv /opt/gpufootprint \
 && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['daemon']))" > /tmp/requirements.txt \
 && /opt/gpufootprint/bin/pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt
# Code layer
COPY setup.py MANIFEST.in README.md LICENSE gpufootprint_probe.pth ./
COPY daemon/ daemon/
# GPUFOOTPRINT_NATIVE=0: no C buffer callbacks built (the probe's, for workload images; the daemon never
# loads them). The daemon's C core is built (GPUFOOTPRINT_NATIVE_CORE is not 0), and its absence fails the
# build: setup.py builds it as optional, so a broken compile would otherwise ship the slower Python paths.
RUN GPUFOOTPRINT_NATIVE=0 /opt/gpufootprint/bin/pip install --no-cache-dir --no-deps /src \
 && /opt/gpufootprint/bin/python -c "from gpufootprint import native; lib, why = native.load(); assert lib, why"

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
 && install -d -o 10001 -g 10001 -m 0755 /run/gpufootprint \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/gpufootprint/oom
COPY --from=build /opt/gpufootprint /opt/gpufootprint
# The metrics address as configuration, not a flag, so the HEALTHCHECK reads the same one; a web
# config (TLS, basic auth) likewise: GPUFOOTPRINT_EXPORTER__WEB_CONFIG_FILE=/etc/gpufootprint/web.yml.
# OOM captures go to /var/lib/gpufootprint/oom (the DaemonSet mounts a volume there): set here because
# the default for a non-root user is its XDG state directory, and this user has no home.
ENV PATH=/opt/gpufootprint/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GPUFOOTPRINT_EXPORTER__LISTEN=0.0.0.0:9878 \
    GPUFOOTPRINT_OOM__DIRECTORY=/var/lib/gpufootprint/oom
USER 10001:10001
EXPOSE 9878
# Speaks TLS when the web config does (python -m gpufootprint.healthcheck reads the daemon's configuration).
HEALTHCHECK --interval=30s --timeout=5s CMD ["python3", "-m", "gpufootprint.healthcheck"]
# Exec form: python is PID 1 and handles SIGTERM itself (daemon and demo both stop cleanly on it).
ENTRYPOINT ["gpufootprint"]
CMD ["daemon"]
