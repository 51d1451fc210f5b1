# syntax=docker/dockerfile:1
#
# cfguard's container image, in two variants chosen with --target:
#
#   openblas  (the default, last stage) the fast engine: cgo with -tags openblas, the predictive
#             engine's matrix products in Debian's OpenBLAS, linked dynamically, on
#             debian:bookworm-slim with libopenblas0-pthread installed by apt (it brings
#             libgfortran5 and libquadmath0) and a nonroot user of uid 65532. ~1.65x PyTorch's
#             speed on the predictive, ~2x the static build's (docs/BENCHMARKS.md's Summary); ~160 MB
#             unpacked, glibc and a shell inside, Debian packages to keep patched.
#   static    a pure-Go binary (CGO_ENABLED=0) on gcr.io/distroless/static-debian12:nonroot: no
#             shell, no libc, uid 65532, CA certificates and tzdata included (Kafka over TLS needs
#             the former); ~40 MB unpacked, nothing to patch but cfguard, and the predictive at
#             ~0.77x PyTorch's speed.
#
#   docker build -t cfguard:dev .
#   docker build --target static -t cfguard:dev-static .
#
# The build commands are deploy/docker/build.sh; deploy/docker_test.go (with
# CFGUARD_IMAGE_BUILDS=1, as .ci/run sets it) runs that script on the files this Dockerfile's
# build context holds (.dockerignore applied) and checks that the default target's cfguard links
# libopenblas.so.0 from the package its stage installs and that the static target's is static,
# then runs each as its image would; so the image's build is tested without a Docker engine.
# The image itself is not built by the tests.
#
# State lives in the volume /var/lib/cfguard (state_dir: the bbolt ledger cfguard.db, the
# embedded broker's data, the posterior export). The default configuration is
# deploy/docker/config.yaml; mount another at /etc/cfguard/config.yaml.

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION}-bookworm AS source
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .

FROM source AS build-static
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    deploy/docker/build.sh /out static && mkdir -p /out/state

FROM source AS build-openblas
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas-dev \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    deploy/docker/build.sh /out openblas

FROM gcr.io/distroless/static-debian12:nonroot AS static
ARG REVISION=unknown
LABEL org.opencontainers.image.title="cfguard" org.opencontainers.image.revision="${REVISION}"
COPY --from=build-static /out/cfguard /out/cfguard-healthcheck /usr/local/bin/
COPY --from=build-static --chown=65532:65532 /out/state /var/lib/cfguard
COPY deploy/docker/config.yaml /etc/cfguard/config.yaml
USER 65532:65532
VOLUME ["/var/lib/cfguard"]
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 CMD ["/usr/local/bin/cfguard-healthcheck"]
ENTRYPOINT ["/usr/local/bin/cfguard"]
CMD ["run", "--config", "/etc/cfguard/config.yaml"]

FROM debian:bookworm-slim AS openblas
ARG REVISION=unknown
LABEL org.opencontainers.image.title="cfguard" org.opencontainers.image.revision="${REVISION}"
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 nonroot \
    && useradd --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin nonroot \
    && mkdir -p /var/lib/cfguard && chown 65532:65532 /var/lib/cfguard
COPY --from=build-openblas /out/cfguard /out/cfguard-healthcheck /usr/local/bin/
COPY deploy/docker/config.yaml /etc/cfguard/config.yaml
USER 65532:65532
VOLUME ["/var/lib/cfguard"]
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 CMD ["/usr/local/bin/cfguard-healthcheck"]
ENTRYPOINT ["/usr/local/bin/cfguard"]
CMD ["run", "--config", "/etc/cfguard/config.yaml"]
