#!/usr/bin/env bash
# Set up from nothing, then train a small transformer LM with mha_ext on the CPU
# and compare it with torch's nn.MultiheadAttention.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_lm.py "$@"
