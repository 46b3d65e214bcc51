#!/usr/bin/env bash
# Build one pinned virtual environment, idempotently.
#   scripts/setup-venv.sh VENV REQUIREMENTS [NODEPS_REQUIREMENTS]
# torch==2.13.0 goes in first (the CPU wheel on this disk) and constrains every later install,
# so no package can pull a multi-GB CUDA build. A stamp keyed on the requirement files (and
# setup.cfg) makes a second run a no-op.
set -euo pipefail
venv=$1; req=$2; nodeps=${3:-}
py=${PYTHON:-python3}
key=$(cat requirements/torch.txt "$req" ${nodeps:+"$nodeps"} setup.cfg pyproject.toml | sha256sum | cut -c1-16)
stamp="$venv/.hfckpt-stamp-$key"
if [ -f "$stamp" ]; then
  exit 0
fi
echo "setup: building $venv from $req${nodeps:+ + $nodeps (--no-deps)}"
start=$(date +%s)
rm -rf "$venv"
"$py" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --disable-pip-version-check --upgrade pip
"$pip" install -q --disable-pip-version-check -r requirements/torch.txt
"$pip" install -q --disable-pip-version-check -c requirements/torch.txt -r "$req"
if [ -n "$nodeps" ]; then
  "$pip" install -q --disable-pip-version-check -c requirements/torch.txt --no-deps -r "$nodeps"
fi
"$pip" install -q --disable-pip-version-check -c requirements/torch.txt --no-deps --no-build-isolation -e .
touch "$stamp"
echo "setup: $venv ready in $(( $(date +%s) - start )) s"
