#!/usr/bin/env bash
# Set up from nothing, then run every test: pytest (Python) and ctest (C++).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
# each stage's start, in minutes since this script began (where a slow machine spends them)
at() { printf '(at %d:%02d)' $((SECONDS / 60)) $((SECONDS % 60)); }
bash scripts/setup.sh --cpp
echo "==> pytest $(at)"
.venv/bin/python -m pytest -q tests "$@"
echo "==> ctest $(at)"
ctest --test-dir build/cmake --output-on-failure
if [ "${MHA_EXT_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "==> ctest under AddressSanitizer + UndefinedBehaviorSanitizer (scripts/sanitize.sh) $(at)"
  bash scripts/sanitize.sh
fi
echo "==> done $(at)"
