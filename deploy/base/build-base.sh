#!/bin/sh
# Builds the offline base image (Debian bookworm minbase + python3, venv, iproute2, iptables)
# with debootstrap and `docker import`, for machines that reach Debian's mirror but no image
# registry. Cached twice: the image itself, and the rootfs tarball under deploy/.cache/.
set -eu
IMAGE="${1:-mqstore-base:bookworm}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${MQSTORE_BASE_CACHE:-$HERE/.cache}"   # the rootfs tarball; MQSTORE_BASE_CACHE moves it
TARBALL="$CACHE/base-bookworm.tar"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKER="${DOCKER:-docker}"

if $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE present"
    exit 0
fi
mkdir -p "$CACHE"
if [ ! -s "$TARBALL" ]; then
    command -v debootstrap >/dev/null || { echo "error: debootstrap is missing (apt-get install -y debootstrap)" >&2; exit 2; }
    [ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root" >&2; exit 2; }
    ROOTFS="$CACHE/rootfs"
    rm -rf "$ROOTFS"
    echo "debootstrap bookworm into $ROOTFS (a few minutes, once)"
    debootstrap --variant=minbase --include=python3,python3-venv,iproute2,iptables,ca-certificates \
        bookworm "$ROOTFS" "$MIRROR"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc \
        "$ROOTFS"/usr/share/man "$ROOTFS"/usr/share/locale
    tar -C "$ROOTFS" -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    rm -rf "$ROOTFS"
fi
$DOCKER import -c 'ENV LANG=C.UTF-8' -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/sh"]' "$TARBALL" "$IMAGE"
echo "base image $IMAGE imported from $TARBALL"
