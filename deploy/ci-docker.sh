#!/bin/sh
# The docker tier of CI (.ci/run runs it after `make test`): Docker engine, image, docker-marked tests.
#
#   deploy/ci-docker.sh            from the repository root, as root on Debian/Ubuntu
#
# 1. installs docker.io, docker-compose and debootstrap if missing, starts dockerd if no engine
#    answers (deploy/ensure-docker.sh);
# 2. builds the image with `make image` (cached: the base image / deploy/.cache rootfs tarball,
#    the dependency wheels, the dependency layer; a cold build runs debootstrap once);
# 3. runs `make test-docker` (tests/docker: a compose project of its own, every drill in a short
#    form, torn down even on failure).
# Prints the seconds each step took; exit code is the first failing step's.
set -eu
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { name=$1; shift; s=$(date +%s); echo "== ci-docker: $name"; "$@"; echo "== ci-docker: $name took $(( $(date +%s) - s )) s"; }
step "docker engine" deploy/ensure-docker.sh
step "image" make image
step "docker tests" make test-docker      # image again: every layer cached, a few seconds
echo "== ci-docker: total $(( $(date +%s) - t0 )) s"
