#!/usr/bin/env bash
# Builds a Debian base image with Python 3 locally, for machines that reach Debian's package
# archive but no image registry:  docker/build-base.sh [TAG]  (default ddiloco-base:bookworm).
# Then: docker build --build-arg BASE=ddiloco-base:bookworm --target synchronizer ...
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail
tag=${1:-ddiloco-base:bookworm}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
chmod 755 "$root"  # the image's / (mktemp made it 0700: unusable by a non-root user)
trap 'rm -rf "$root" "$root.log"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$root" "$mirror" > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
# what an image never needs: package caches, documentation, man pages, locales
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
       "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
# the host's extra certificate authorities, so that pip inside `docker build` trusts the same
# TLS endpoints the host does
if [ -d /usr/local/share/ca-certificates ]; then
    cp -r /usr/local/share/ca-certificates/. "$root"/usr/local/share/ca-certificates/ 2>/dev/null || true
    chroot "$root" update-ca-certificates >/dev/null 2>&1 || true
fi
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
echo "$tag"
