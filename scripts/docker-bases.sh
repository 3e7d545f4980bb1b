#!/usr/bin/env bash
# docker-bases.sh: local stand-ins for the Dockerfiles' base images, made
# from Debian packages, for machines that cannot reach an image registry
# (the Dockerfiles' defaults, golang:… and nvidia/cuda:…, come from Docker
# Hub). Starts dockerd first when none answers. Idempotent: an image that
# exists is kept while this script is unchanged (its label
# meshgpu.bases.recipe is the script's hash); docker image rm one to remake it.
#
#   bash scripts/docker-bases.sh [debian] [cuda] [go]     (default: debian cuda)
#
#   debian  $DEBIAN_IMAGE: debootstrap --variant=minbase bookworm plus
#           ca-certificates, imported (the debian:bookworm-slim stand-in)
#   cuda    $CUDA_IMAGE: that plus Debian non-free's CUDA 11.8 runtime
#           libraries, what libmeshgpu_cuda.so links (the nvidia/cuda:…-runtime
#           stand-in; the container toolkit adds the driver under --gpus)
#   go      $GO_IMAGE: that plus gcc, make, git and the Go toolchain from the
#           module proxy (golang.org/toolchain, the host's Go version): the
#           golang:…-bookworm stand-in, to compile inside Docker
#
# Then build with those as the bases (docs/docker.md; scripts/docker-test.sh
# does it):
#   docker build --network host --build-arg GO_IMAGE=$GO_IMAGE \
#     --build-arg RUNTIME_IMAGE=$DEBIAN_IMAGE -t meshgpu:cpu .
#
# dockerd, when this script starts it: --bridge=none --iptables=false (builds
# and containers use --network host or none), storage overlay2, else vfs;
# log in $MESHGPU_DOCKER_CACHE/dockerd.log. It is left running.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${MESHGPU_DOCKER_CACHE:-/var/cache/meshgpu-docker}
DEBIAN_IMAGE=${DEBIAN_IMAGE:-meshgpu-local/debian:bookworm-slim}
CUDA_IMAGE=${CUDA_IMAGE:-meshgpu-local/cuda:11.8-runtime-bookworm}
GO_IMAGE=${GO_IMAGE:-meshgpu-local/golang:1.26-bookworm}
# What libmeshgpu_cuda.so needs at run time (ldd; CUDA's runtime itself is
# linked statically): cuBLAS and cuBLASLt.
CUDA_PACKAGES=${CUDA_PACKAGES:-libcublas11 libcublaslt11}

say() { echo "docker-bases: $*" >&2; }
die() { say "$*"; exit 1; }
# A base made by another version of this script is made again.
RECIPE=$(sha256sum "$self" | cut -c1-16)
have_image() {
  [ "$(docker image inspect -f '{{index .Config.Labels "meshgpu.bases.recipe"}}' "$1" 2>/dev/null)" = "$RECIPE" ]
}
mkdir -p "$CACHE"

# apt_install installs Debian packages on this machine when a command is missing.
apt_install() {
  command -v "$1" >/dev/null && return
  [ "$(id -u)" = 0 ] || die "$1 not found: apt-get install $2 (as root)"
  say "installing $2"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null 2>&1 \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null; }
}

# ensure_daemon starts dockerd unless one answers.
ensure_daemon() {
  apt_install docker docker.io
  docker info >/dev/null 2>&1 && return
  apt_install dockerd docker.io
  [ "$(id -u)" = 0 ] || die "no Docker daemon answers, and only root can start one"
  local driver
  for driver in overlay2 vfs; do
    say "starting dockerd (storage driver $driver; log $CACHE/dockerd.log)"
    setsid dockerd --bridge=none --iptables=false --ip6tables=false --storage-driver="$driver" \
      >>"$CACHE/dockerd.log" 2>&1 </dev/null &
    local pid=$!
    for _ in $(seq 60); do
      docker info >/dev/null 2>&1 && { say "dockerd $pid is up"; return; }
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  tail -20 "$CACHE/dockerd.log" >&2
  die "dockerd does not start (log above)"
}

# build IMAGE DOCKERFILE-TEXT [CONTEXT]: docker build with host networking
# (the build's apt-get reaches the Debian archive as this machine does).
build() {
  local image=$1 text=$2 ctx=${3:-} log empty=""
  log=$CACHE/build-$(printf '%s' "$image" | tr '/:' '--').log
  if [ -z "$ctx" ]; then empty=$(mktemp -d); ctx=$empty; fi
  printf '%s\nLABEL meshgpu.bases.recipe=%s\n' "$text" "$RECIPE" | docker build --force-rm --network host --build-arg BASE="$DEBIAN_IMAGE" -t "$image" -f - "$ctx" >"$log" 2>&1 \
    || { tail -30 "$log" >&2; die "docker build $image failed (log $log)"; }
  [ -z "$empty" ] || rmdir "$empty"
}

# unmount_under DIR: whatever debootstrap left mounted under DIR.
unmount_under() {
  local m
  for m in $(awk -v d="$1" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
}

make_debian() {
  have_image "$DEBIAN_IMAGE" && { say "$DEBIAN_IMAGE: there"; return; }
  apt_install debootstrap debootstrap
  local t0=$SECONDS root
  root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'unmount_under "'"$root"'"; rm -rf --one-file-system "'"$root"'"' EXIT
  mkdir -p "$CACHE/debs"
  say "debootstrap $SUITE into $root (packages cached in $CACHE/debs)"
  debootstrap --variant=minbase --include=ca-certificates --cache-dir="$CACHE/debs" \
    "$SUITE" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  unmount_under "$root"
  cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main non-free
deb $MIRROR $SUITE-updates main non-free
deb ${MIRROR%/debian}/debian-security $SUITE-security main non-free
EOF
  # As debian:…-slim: no docs, man pages or locales, now or from later
  # apt-get installs; no package lists.
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  echo 'APT::Install-Recommends "false";' >"$root/etc/apt/apt.conf.d/docker-no-recommends"
  # As the official images: no .deb left behind by apt-get install.
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  find "$root/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/lib/apt/lists/* \
    "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
  find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' --change "LABEL meshgpu.bases.recipe=$RECIPE" - "$DEBIAN_IMAGE" >/dev/null
  rm -rf --one-file-system "$root"
  trap - EXIT
  say "$DEBIAN_IMAGE: made in $((SECONDS - t0)) s"
}

make_cuda() {
  have_image "$CUDA_IMAGE" && { say "$CUDA_IMAGE: there"; return; }
  make_debian
  local t0=$SECONDS
  say "$CUDA_IMAGE: installing $CUDA_PACKAGES (Debian non-free)"
  build "$CUDA_IMAGE" "ARG BASE
FROM \${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $CUDA_PACKAGES \\
 && apt-get clean && rm -rf /var/lib/apt/lists/*
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility"
  say "$CUDA_IMAGE: made in $((SECONDS - t0)) s"
}

make_go() {
  have_image "$GO_IMAGE" && { say "$GO_IMAGE: there"; return; }
  make_debian
  command -v go >/dev/null || die "go not found: the Go toolchain comes through the module proxy, by the go command"
  local t0=$SECONDS ver mod dir ctx
  ver=$(go env GOVERSION)
  mod=golang.org/toolchain@v0.0.1-$ver.linux-amd64
  say "$GO_IMAGE: Go toolchain $mod (module proxy)"
  dir=$(cd "$CACHE" && go mod download -json "$mod" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')
  [ -f "$dir/bin/go" ] || die "go mod download $mod gave no toolchain (dir '$dir')"
  # The module cache keeps it read-only and without exec bits (the go
  # command sets them when it switches toolchains): a writable copy with them.
  ctx=$CACHE/go-context
  rm -rf "${ctx:?}" && mkdir -p "$ctx/ca" && cp -r "$dir" "$ctx/go" && chmod -R u+w "$ctx/go"
  find "$ctx/go/bin" "$ctx/go/pkg/tool" -type f -exec chmod a+x {} +
  # The CAs this machine adds to Debian's (a TLS-inspecting egress proxy's,
  # say), so `go mod download` in a build reaches the proxy as the host
  # does. Only this builder base gets them, never the runtime images.
  cp /usr/local/share/ca-certificates/*.crt "$ctx/ca/" 2>/dev/null || true
  build "$GO_IMAGE" "ARG BASE
FROM \${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y gcc libc6-dev make git \\
 && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
COPY go /usr/local/go
ENV GOPATH=/go GOTOOLCHAIN=local PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /go" "$ctx"
  rm -rf "${ctx:?}"
  say "$GO_IMAGE: made in $((SECONDS - t0)) s"
}

ensure_daemon
# Without buildx the CLI's builder is the legacy one (no BuildKit).
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
[ $# -gt 0 ] || set -- debian cuda
for b in "$@"; do
  case $b in
    debian) make_debian ;;
    cuda) make_cuda ;;
    go) make_go ;;
    *) die "unknown base '$b' (debian, cuda or go)" ;;
  esac
done
