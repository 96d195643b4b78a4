#!/usr/bin/env bash
# Installs the Debian packages the tests need when they are missing. As root this uses apt-get;
# otherwise it names what to install and carries on (the tests that need a package then fail clearly).
set -euo pipefail
missing=()
for pkg in "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing system packages: ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "warning: missing system packages: ${missing[*]} (install them with: sudo apt-get install ${missing[*]})" >&2
fi
