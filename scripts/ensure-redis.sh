#!/usr/bin/env bash
# Tests start their own redis-server processes on free ports; they only need the binary.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "redis-server not found: installing it with apt-get"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  exit 0
fi
echo "redis-server is needed by the tests: install it (apt-get install redis-server, brew install redis) and rerun make test" >&2
exit 1
