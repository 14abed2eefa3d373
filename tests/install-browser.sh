#!/usr/bin/env bash
# Headless Chromium (Debian's package) for the test that renders audit.html in a real browser.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends chromium >/dev/null
