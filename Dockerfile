# syntax=docker/dockerfile:1
# The Switchyard service images, one target each: lwepp, bbr, simulator.
#   make images                        # docker build of all three (see Makefile)
#   docker build --target lwepp -t switchyard/lwepp:0.1.0 .
# Without a Docker daemon, `make images-oci` builds the same images from
# Debian's packages into an OCI layout (images/build.py).
#
# Repeatable: dependencies come from images/requirements.lock (every package
# pinned, wheel hashes checked); pin the base image by digest with
# --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
# Wheels are locked for linux/amd64, as GIE's images.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM --platform=linux/amd64 ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY images/requirements.lock images/requirements.lock
RUN python -m pip install --no-cache-dir --disable-pip-version-check --no-deps --no-compile \
        --only-binary=:all: --require-hashes --target /opt/switchyard/lib \
        -r images/requirements.lock
COPY pyproject.toml README.md ./
COPY plugin_api plugin_api
COPY wire wire
COPY serving serving
COPY pods pods
COPY blockhash blockhash
COPY lwepp lwepp
COPY bbr bbr
COPY onehop onehop
COPY simulator simulator
RUN python -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps \
        --wheel-dir /tmp/dist . \
 && rm -rf /opt/switchyard/lib/bin \
 && python -m pip install --no-cache-dir --disable-pip-version-check --no-deps --no-compile \
        --target /opt/switchyard/lib /tmp/dist/switchyard-*.whl \
 && rm -rf /opt/switchyard/lib/bin \
 && PYTHONHASHSEED=0 python -m compileall -q -f --invalidation-mode=unchecked-hash \
        /opt/switchyard/lib

# What runs: the slim Python, the installed packages, no pip or build tools.
FROM --platform=linux/amd64 ${PYTHON_IMAGE} AS runtime
RUN python -m pip uninstall --yes --quiet pip setuptools wheel \
 && rm -f /usr/local/bin/pip* \
 && echo 'nonroot:x:65532:65532:nonroot:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'nonroot:x:65532:' >> /etc/group
COPY --from=build /opt/switchyard /opt/switchyard
# The commit the image is built from, for the services' *_info metrics
# (make images passes it: --build-arg SWITCHYARD_COMMIT=$(git rev-parse HEAD)).
ARG SWITCHYARD_COMMIT=unknown
ENV PYTHONPATH=/opt/switchyard/lib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SWITCHYARD_COMMIT=${SWITCHYARD_COMMIT}
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
WORKDIR /

# Health: both services serve the standard gRPC health service on their own
# port. Kubernetes probes it natively (grpc: {port: 9003, service:
# inference-extension}; see manifests/). HEALTHCHECK is for plain Docker and
# assumes the default health port.
FROM runtime AS lwepp
EXPOSE 9002 9003 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:9003')).Check(h.HealthCheckRequest(service='inference-extension'), timeout=2).status; sys.exit(s != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["python", "-m", "lwepp", "--host=0.0.0.0"]

FROM runtime AS bbr
EXPOSE 9004 9005 9091
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:9005')).Check(h.HealthCheckRequest(service=''), timeout=2).status; sys.exit(s != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["python", "-m", "bbr", "--host=0.0.0.0"]

FROM runtime AS simulator
EXPOSE 8000
ENTRYPOINT ["python", "-m", "simulator"]
