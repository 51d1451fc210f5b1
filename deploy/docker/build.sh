#!/bin/sh
# build.sh OUT_DIR [static|openblas]: builds cfguard and cfguard-healthcheck into OUT_DIR, run
# from the module's root. The Dockerfile's build stages run exactly this; deploy/docker_test.go
# runs it directly.
#
#   static    CGO_ENABLED=0: a statically linked binary that needs nothing from the image.
#   openblas  CGO_ENABLED=1 -tags openblas: the predictive engine's matrix products go to
#             OpenBLAS (bnn), so the binary is dynamically linked against libopenblas.so.0 (and
#             libc); build with libopenblas-dev installed, run with libopenblas0 installed.
#
# -trimpath and an empty build ID make the binary independent of where it was built;
# -buildvcs=false because the image's build context carries no .git (the revision goes into
# the image's org.opencontainers.image.revision label instead).
set -eu
out=${1:?usage: build.sh OUT_DIR [static|openblas]}
variant=${2:-static}
ldflags="-s -w -buildid="
case "$variant" in
static) cgo=0 tags="" ;;
openblas) cgo=1 tags="openblas" ;;
*)
	echo "build.sh: unknown variant \"$variant\" (want static or openblas)" >&2
	exit 2
	;;
esac
mkdir -p "$out"
CGO_ENABLED=$cgo go build -trimpath -buildvcs=false -tags "$tags" -ldflags "$ldflags" -o "$out/cfguard" ./cmd/cfguard
# The health check is always pure Go: it runs in either image.
CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags "$ldflags" -o "$out/cfguard-healthcheck" ./deploy/healthcheck
