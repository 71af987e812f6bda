#!/usr/bin/env bash
# System packages some tests use, from Debian/Ubuntu's apt (the README's test command and .ci/run run
# this first): promtool (package prometheus) for `promtool check config/metrics`, docker-compose to
# validate deploy/docker-compose.yml, and chromium, which Playwright drives to test the live view
# (Playwright's own browser download comes from a CDN, not a package registry). Only missing tools are installed; without apt (or root/sudo) it
# says so and exits 0, and the tests that need a tool skip naming it.
set -euo pipefail

declare -A PACKAGE_OF=([promtool]=prometheus [docker-compose]=docker-compose [chromium]=chromium)
missing=()
for tool in "${!PACKAGE_OF[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("${PACKAGE_OF[$tool]}")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: no apt-get here; not installing ${missing[*]} (their tests will skip)" >&2
    exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "install_system_deps: not root and no sudo; not installing ${missing[*]} (their tests will skip)" >&2
        exit 0
    fi
    SUDO=(sudo)
fi
install() {
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}
# A fresh machine may have no package lists yet: update only when the install needs it.
install >/dev/null || { "${SUDO[@]}" apt-get update -qq && install >/dev/null; }
