#!/usr/bin/env bash
# Memorisation check after the scheduler moved to one request factor, scored tree nodes, cut-whole trees as plain
# steps and the verifying step's bookkeeping in its cost. The steps (cache, train 300 steps, eval fixed and auto in
# float32) are bench/memorise.sh's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec bash bench/memorise.sh "${D:-runs/memorise8-request-factor}"
