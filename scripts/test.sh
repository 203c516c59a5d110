#!/usr/bin/env bash
# Set up from nothing, then run every test: pytest (Python) and ctest (C++).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
bash scripts/setup.sh --cpp
echo "==> pytest"
.venv/bin/python -m pytest -q tests "$@"
echo "==> ctest"
ctest --test-dir build/cmake --output-on-failure
if [ "${MHA_EXT_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "==> ctest under AddressSanitizer + UndefinedBehaviorSanitizer (scripts/sanitize.sh)"
  bash scripts/sanitize.sh
fi
