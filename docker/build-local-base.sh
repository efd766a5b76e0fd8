#!/usr/bin/env bash
# Make a Debian bookworm + Python 3.11 base image without an image registry, for
#   docker build --build-arg BASE_IMAGE=<tag> -f docker/Dockerfile.cpu ...
# (docker/README.md). Needs root, debootstrap and a reachable Debian mirror.
#
# Usage: docker/build-local-base.sh [TAG]     (default TAG: dspark-local/python:3.11-bookworm)
# Env:   DEBIAN_MIRROR  (default: the first Debian mirror of /etc/apt/sources.list*)
#        CA_DIR         (default: /usr/local/share/ca-certificates; its *.crt files are trusted
#                        inside the image, so pip gets through a TLS-intercepting proxy)
set -euo pipefail
tag=${1:-dspark-local/python:3.11-bookworm}
ca_dir=${CA_DIR:-/usr/local/share/ca-certificates}
mirror=${DEBIAN_MIRROR:-$(grep -hoE 'https?://[^ ]*/debian/?( |$)' \
    /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | head -n1 | tr -d ' ' || true)}
mirror=${mirror:-http://deb.debian.org/debian}

root=$(mktemp -d /tmp/dspark-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
start=$SECONDS
# python3-venv brings ensurepip's bundled pip: the Dockerfile makes its own venv, so the
# system interpreter stays untouched (Debian marks it externally managed).
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror"
if compgen -G "$ca_dir/*.crt" >/dev/null; then
    cp "$ca_dir"/*.crt "$root/usr/local/share/ca-certificates/"
fi
chroot "$root" update-ca-certificates
# pip reads certifi's bundle unless told otherwise; point it at the system store.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log

# docker import sets no environment; give it what Debian's own images have.
tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag"
echo "built $tag in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
