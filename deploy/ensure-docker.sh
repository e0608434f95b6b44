#!/bin/sh
# Makes sure a Docker engine answers: as root on Debian, installs docker.io, docker-compose and
# debootstrap when missing and starts dockerd in the background (log: /var/log/dockerd.log).
set -eu
if docker info >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
    echo "error: no Docker engine answers and this is not root; start dockerd (or join the docker group)" >&2
    exit 2
fi
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
    command -v apt-get >/dev/null || { echo "error: install Docker, docker-compose and debootstrap" >&2; exit 2; }
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
fi
if ! pgrep -x dockerd >/dev/null; then
    echo "starting dockerd (log /var/log/dockerd.log)"
    nohup dockerd >>/var/log/dockerd.log 2>&1 &
fi
i=0
until docker info >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -le 60 ] || { echo "error: dockerd did not answer in 30 s; see /var/log/dockerd.log" >&2; exit 2; }
    sleep 0.5
done
