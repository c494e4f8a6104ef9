# Images of the two ddiloco services, one target each:
#
#   docker build --target synchronizer -t ddiloco-synchronizer:0.1.0 .
#   docker build --target learner      -t ddiloco-learner:0.1.0 .
#
# Build arguments:
#   BASE             a Debian-based image with Python 3.11+ and `python3 -m venv` (default: the official
#                    slim image). Where no registry is reachable, build one locally (docker/README.md).
#   TORCH_SPEC       the torch requirement (default the CPU build this project is tested with).
#   TORCH_INDEX_URL  where torch comes from: the CPU wheels by default; for a GPU image, e.g.
#                    https://download.pytorch.org/whl/cu128 (and a CUDA-capable BASE or the driver's
#                    libraries from the node, as the NVIDIA device plugin provides them).
#   PIP_OFFLINE      1: install only from docker/wheels/ (a wheelhouse put there before the build).
#
# Each image holds one virtual environment at /opt/ddiloco with only its service's packages (the
# lab and the simulator are not in either), runs as the unprivileged user 10001, and has
# `ddiloco` as its entry point. The synchronizer keeps its durable state in the volume /state.
ARG BASE=python:3.11-slim

# torch and the libraries both services use, in one virtual environment
FROM ${BASE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
ARG PIP_OFFLINE=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY . /src/
RUN set -eu; \
    if [ "$PIP_OFFLINE" = 1 ]; then export PIP_NO_INDEX=1; fi; \
    python3 -m venv /opt/ddiloco; \
    cd /src && /opt/ddiloco/bin/pip install --find-links docker/wheels --extra-index-url "$TORCH_INDEX_URL" \
        "$TORCH_SPEC" ./libs/core ./libs/fragments ./libs/protocol

FROM build AS build-synchronizer
ARG PIP_OFFLINE=0
RUN set -eu; \
    if [ "$PIP_OFFLINE" = 1 ]; then export PIP_NO_INDEX=1; fi; \
    cd /src && /opt/ddiloco/bin/pip install --find-links docker/wheels ./libs/algorithm ./services/synchronizer

# what both images share: the unprivileged user and the environment. Every instruction that only
# sets metadata comes before the large COPY of the environment (cheaper with copy-based storage).
FROM ${BASE} AS runtime
RUN set -eu; \
    echo 'ddiloco:x:10001:' >> /etc/group; \
    echo 'ddiloco:x:10001:10001:ddiloco:/home/ddiloco:/usr/sbin/nologin' >> /etc/passwd; \
    mkdir -p /home/ddiloco /state; chown 10001:10001 /home/ddiloco /state
# GLIBC_TUNABLES: fragment-sized buffers on transparent huge pages (ddiloco.core.resources.with_huge_pages)
ENV PATH=/opt/ddiloco/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/home/ddiloco GLIBC_TUNABLES=glibc.malloc.hugetlb=1
WORKDIR /home/ddiloco
USER 10001:10001
ENTRYPOINT ["ddiloco"]

FROM runtime AS synchronizer
VOLUME ["/state"]
EXPOSE 7000 9100
CMD ["synchronizer", "--listen", "0.0.0.0:7000", "--state-dir", "/state"]
COPY --from=build-synchronizer /opt/ddiloco /opt/ddiloco

# (after the synchronizer's stages: a builder without BuildKit builds every stage before its target)
FROM build AS build-learner
ARG PIP_OFFLINE=0
RUN set -eu; \
    if [ "$PIP_OFFLINE" = 1 ]; then export PIP_NO_INDEX=1; fi; \
    cd /src && /opt/ddiloco/bin/pip install --find-links docker/wheels ./libs/algorithm ./libs/training ./services/learner

FROM runtime AS learner
EXPOSE 9101
CMD ["learner", "--help"]
COPY --from=build-learner /opt/ddiloco /opt/ddiloco
