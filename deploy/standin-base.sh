#!/bin/sh
# A stand-in for python:3.11-slim-bookworm, ONLY for a machine that cannot reach any container
# registry but can reach a Debian mirror. The real build uses the official image: docker or
# podman pulls it by the FROM line of deploy/Dockerfile. This one was made so that the Dockerfile
# could be built and run on such a machine (docs/deploy.md, "The image").
#
#   sudo deploy/standin-base.sh [ROOTFS_DIR] [DEBIAN_MIRROR]
#
# It needs root, debootstrap and podman, and imports the result under the official name, so
# `podman build --pull=never -f deploy/Dockerfile .` uses it. Remove it afterwards with
# `podman rmi docker.io/library/python:3.11-slim-bookworm`, or a later real build with
# --pull=never would take it for the official image.
#
# How it differs from the official image: Python is Debian's python3.11 (3.11.2, in /usr/bin)
# with Debian's pip 23.0.1, not a python.org build in /usr/local; the same distribution
# (bookworm), the same commands (python, python3, pip, pip3), no EXTERNALLY-MANAGED marker
# (the official image has none), LANG=C.UTF-8 and CMD python3 as there.
set -eu

ROOTFS=${1:-/tmp/caldrix-standin-rootfs}
MIRROR=${2:-http://deb.debian.org/debian}
TAG=docker.io/library/python:3.11-slim-bookworm

if [ -e "$ROOTFS" ]; then
    echo "$ROOTFS exists; give an empty path" >&2
    exit 1
fi

debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR"

# The official image's sources: bookworm, its updates and its security suite.
rm -f "$ROOTFS/etc/apt/sources.list"
cat > "$ROOTFS/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF

# debootstrap took bookworm's release; the official image is rebuilt with its updates.
chroot "$ROOTFS" apt-get update
chroot "$ROOTFS" env DEBIAN_FRONTEND=noninteractive apt-get upgrade -y
chroot "$ROOTFS" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    python3 python3-pip python3-venv python-is-python3 ca-certificates
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
rm -f "$ROOTFS"/usr/lib/python3.*/EXTERNALLY-MANAGED
# debootstrap leaves the building host's name and resolver behind; a container gets its own.
: > "$ROOTFS/etc/resolv.conf"
echo localhost > "$ROOTFS/etc/hostname"

# pip, pip3, python and python3 all exist, as in the official image.
for cmd in python python3 pip pip3; do
    chroot "$ROOTFS" sh -c "command -v $cmd" >/dev/null || { echo "no $cmd in the stand-in" >&2; exit 1; }
done

tar -C "$ROOTFS" -c . | podman import \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
podman run --rm --network none "$TAG" sh -c 'python --version && pip --version'
