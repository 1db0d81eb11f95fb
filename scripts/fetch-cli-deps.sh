#!/usr/bin/env bash
# Unpacks the two header-only packages the flashkda CLI needs (CLI11, nlohmann/json) from
# Debian's .debs into .deps/ at the repository root, for a machine without apt (the GPU host):
#
#   scripts/fetch-cli-deps.sh            # here, where apt works: .deps/usr/{include,share/cmake}
#   cmake -S . -B build -G Ninja -DCMAKE_PREFIX_PATH=$PWD/.deps/usr   # there (or here)
#
# tools/flashkda/CMakeLists.txt also searches .deps/usr by itself, after the system paths.
# Needs apt-get and dpkg-deb; no root (apt-get download writes to the current directory). Run
# `apt-get update` first on a fresh machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.deps"
packages=(libcli11-dev nlohmann-json3-dev)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# As root, apt downloads as the _apt user: let it write into the temporary folder.
if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then chown _apt "$tmp"; fi
(cd "$tmp" && apt-get download "${packages[@]}")

rm -rf "$dest"
mkdir -p "$dest"
for deb in "$tmp"/*.deb; do
  echo "fetch-cli-deps: unpacking $(basename "$deb")"
  dpkg -x "$deb" "$dest"
done

for config in "$dest/usr/share/cmake/CLI11/CLI11Config.cmake" \
              "$dest/usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake"; do
  [ -f "$config" ] || { echo "fetch-cli-deps: $config is missing after unpacking" >&2; exit 1; }
done
echo "fetch-cli-deps: done; configure with -DCMAKE_PREFIX_PATH=$dest/usr"
