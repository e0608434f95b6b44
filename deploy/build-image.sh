#!/bin/sh
# `make image`: the offline base (once), the wheelhouse (deps cached), then the image.
#   deploy/build-image.sh [IMAGE]      env: PYTHON (a python with pip), BASE (skip the local base),
#                                           DOCKER (docker client)
set -eu
IMAGE="${1:-mqstore:latest}"
DEPLOY="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$DEPLOY")"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
DOCKER="${DOCKER:-docker}"
WH="$DEPLOY/.wheelhouse"

if [ -z "${BASE:-}" ]; then
    BASE=mqstore-base:bookworm
    DOCKER="$DOCKER" "$DEPLOY/base/build-base.sh" "$BASE"
fi

mkdir -p "$WH/deps" "$WH/project"
# requirements.txt = [project.dependencies]; deps are re-wheeled only when it changes.
"$PYTHON" - "$ROOT/pyproject.toml" "$WH/requirements.txt.new" <<'PY'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
open(sys.argv[2], "w").write("\n".join(deps) + "\n")
PY
if ! cmp -s "$WH/requirements.txt.new" "$WH/requirements.txt" || [ -z "$(ls "$WH/deps")" ]; then
    rm -f "$WH/deps/"*.whl
    "$PYTHON" -m pip wheel -q --wheel-dir "$WH/deps" -r "$WH/requirements.txt.new"
    mv "$WH/requirements.txt.new" "$WH/requirements.txt"
else
    rm -f "$WH/requirements.txt.new"
fi
rm -f "$WH/project/"*.whl
"$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WH/project" "$ROOT" 2>&1 | grep -v -i -E 'warn|licen|\*\*\*|!!|^ *$|corresp|see https' || true
ls "$WH/project/"*.whl >/dev/null

$DOCKER build -q -f "$DEPLOY/Dockerfile" --build-arg "BASE=$BASE" -t "$IMAGE" "$DEPLOY"
echo "image $IMAGE built on $BASE"
