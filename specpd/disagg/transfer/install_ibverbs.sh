#!/bin/sh
# Provide libibverbs1 (+ libnl-3-200, libnl-route-3-200), the system library the Mooncake wheel links to.
# Usage: install_ibverbs.sh VENV   (run by `make install`)
#   root with apt-get: apt-get install libibverbs1 (apt-get update only when that first try fails);
#   otherwise: `apt-get download` the .debs and extract them into VENV/lib/specpd-ibverbs, which
#   specpd/disagg/transfer/mooncake.py preloads with ctypes (override the place with SPECPD_IBVERBS_DIR).
# Never fails: without the library the mooncake backend reports why and the tcp backend still works.
venv=${1:-.venv}
pkgs="libibverbs1 libnl-3-200 libnl-route-3-200"

if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    if apt-get install -y -qq libibverbs1 >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; }; then
        exit 0
    fi
fi
dest="$venv/lib/specpd-ibverbs"
if [ -n "$(find "$dest" -name 'libibverbs.so.1*' 2>/dev/null)" ]; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    if (cd "$tmp" && apt-get download $pkgs >/dev/null 2>&1); then
        mkdir -p "$dest"
        for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$dest"; done
        rm -rf "$tmp"
        exit 0
    fi
    rm -rf "$tmp"
fi
echo "warning: libibverbs1 is not available: the mooncake transfer backend will not load (tcp still works)" >&2
exit 0
