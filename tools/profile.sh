#!/usr/bin/env bash
# SPEC §9's name for `minivllm profile`: tools/profile.sh PID SECONDS [OUT_DIR]
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: tools/profile.sh PID SECONDS [OUT_DIR]" >&2
    exit 2
fi
exec python -m minivllm profile --pid "$1" --seconds "$2" --out-dir "${3:-.}"
