# meshgpu with the CPU backend only (no CUDA layers), for machines without a GPU:
#   docker build -t meshgpu:cpu .
#   docker run -p 7001:7001 -v meshgpu-data:/data meshgpu:cpu run --model org/name --listen 0.0.0.0:7001
# Dockerfile.cuda is the GPU image (tagged meshgpu). docs/docker.md: volumes,
# the healthcheck, and building where no image registry can be reached
# (scripts/docker-bases.sh makes the bases from Debian packages).

# The bases are build args, so local stand-ins can replace them.
ARG GO_IMAGE=golang:1.26-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

# --- Go binary (CPU backend compiled in) ---
FROM ${GO_IMAGE} AS go-build
# VERSION: what --version prints (the context has no .git), e.g.
# --build-arg VERSION=$(git describe --tags --always --dirty).
ARG VERSION
# PREBUILT_BIN=1: take docker/prebuilt/meshgpu, built outside by `make build`.
ARG PREBUILT_BIN
WORKDIR /src
COPY go.mod go.sum ./
RUN if [ -z "$PREBUILT_BIN" ]; then go mod download; fi
COPY . .
RUN if [ -n "$PREBUILT_BIN" ]; then install -D -m 0755 docker/prebuilt/meshgpu /out/meshgpu; \
    else make build BIN=/out/meshgpu ${VERSION:+VERSION=$VERSION}; fi

# --- runtime ---
FROM ${RUNTIME_IMAGE}
RUN if [ ! -s /etc/ssl/certs/ca-certificates.crt ]; then \
      apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*; fi \
 && useradd --uid 10001 --user-group --home-dir /data --no-create-home --shell /usr/sbin/nologin meshgpu \
 && mkdir -p /data && chown meshgpu:meshgpu /data
COPY --from=go-build /out/meshgpu /usr/local/bin/meshgpu
# /data holds the node's key (~/.meshgpu) and the hub cache (--model org/name).
ENV HOME=/data \
    MESHGPU_CACHE_DIR=/data/hub \
    MESHGPU_HEALTH_URL=http://127.0.0.1:7001/health
USER meshgpu
WORKDIR /data
VOLUME ["/data"]
EXPOSE 7001
HEALTHCHECK --interval=30s --timeout=10s --start-period=5m --retries=3 \
  CMD ["meshgpu", "health"]
ENTRYPOINT ["meshgpu"]
CMD ["--help"]
