#!/usr/bin/env bash
# Set up from nothing, then run every test: pytest (Python) and ctest (C++).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
# each stage's start, in minutes since this script began (where a slow machine spends them)
at() { printf '(at %d:%02d)' $((SECONDS / 60)) $((SECONDS % 60)); }
bash scripts/setup.sh --cpp
# The sanitizer build (scripts/sanitize.sh) runs while pytest does, at the
# lowest priority: pytest keeps a core busy, the build takes what is left
# and its ctest runs at the end.
san=""
if [ "${MHA_EXT_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "==> building with AddressSanitizer + UndefinedBehaviorSanitizer while pytest runs (build/sanitize-bg.log) $(at)"
  setsid nice -n 19 bash scripts/sanitize.sh --build >build/sanitize-bg.log 2>&1 &
  san=$!
  trap 'kill -- -"$san" 2>/dev/null || true' EXIT  # (a failed stage stops the build with it)
fi
echo "==> pytest $(at)"
.venv/bin/python -m pytest -q tests "$@"
echo "==> ctest $(at)"
ctest --test-dir build/cmake --output-on-failure
if [ -n "$san" ]; then
  echo "==> waiting for the sanitizer build $(at)"
  wait "$san" || { cat build/sanitize-bg.log >&2; exit 1; }
  trap - EXIT
  cat build/sanitize-bg.log
  echo "==> ctest under AddressSanitizer + UndefinedBehaviorSanitizer (scripts/sanitize.sh) $(at)"
  bash scripts/sanitize.sh --test
fi
echo "==> done $(at)"
