#!/usr/bin/env bash
# The demo: installs what is missing into .venv, then trains a small GPT on 2 local ranks.
#   bash scripts/demo.sh [--nproc N] [--steps N] [--mode fsdp|hsdp|replicate] [--mp bf16] ...
set -euo pipefail
EXTRAS=demo source "$(dirname "$0")/env.sh"
"$py" -m funcshard demo "$@"
