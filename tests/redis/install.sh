#!/usr/bin/env bash
# Installs a Redis server for the tests into .redis/ (no root needed): Debian's
# redis-tools package and the two libraries it needs that a base system lacks, unpacked
# with dpkg-deb, behind .redis/bin/redis-server and .redis/bin/redis-cli (wrappers that
# set the library path; the cluster tests create their cluster with redis-cli). A
# redis-server (and redis-cli) already on PATH is used as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.redis
if [ -x "$OUT/bin/redis-server" ] && "$OUT/bin/redis-server" --version >/dev/null 2>&1 \
  && [ -x "$OUT/bin/redis-cli" ] && "$OUT/bin/redis-cli" --version >/dev/null 2>&1; then
  exit 0
fi
rm -rf "$OUT"
mkdir -p "$OUT/bin"
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  ln -s "$(command -v redis-server)" "$OUT/bin/redis-server"
  ln -s "$(command -v redis-cli)" "$OUT/bin/redis-cli"
else
  mkdir -p "$OUT/debs" "$OUT/root"
  pkgs="redis-tools libjemalloc2 liblzf1"
  if ! (cd "$OUT/debs" && apt-get download $pkgs >/dev/null 2>&1); then
    # No package lists yet (a fresh container): fetch them (root only), then retry.
    [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null
    (cd "$OUT/debs" && apt-get download $pkgs >/dev/null)
  fi
  for d in "$OUT"/debs/*.deb; do dpkg-deb -x "$d" "$OUT/root"; done
  root=$(cd "$OUT/root" && pwd)
  # Debian's redis-server is the redis-check-rdb binary under another name.
  ln -s redis-check-rdb "$root/usr/bin/redis-server"
  for tool in redis-server redis-cli; do
    cat > "$OUT/bin/$tool" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$root/usr/bin/$tool" "\$@"
WRAP
    chmod +x "$OUT/bin/$tool"
  done
fi
"$OUT/bin/redis-server" --version
"$OUT/bin/redis-cli" --version
