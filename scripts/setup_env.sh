#!/usr/bin/env bash
# Create .venv in the repository and install megatron_zero into it (editable),
# building csrc/ where a compiler is present. A second run with nothing changed
# returns in well under a second: a stamp records what was installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.megatron_zero_installed"
want="$(cat requirements.txt setup.py $(find csrc -type f 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
echo "setup_env: installing requirements into $venv" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
"$venv/bin/python" -c "import torch, numpy, sentencepiece" \
    || { echo "setup_env: the requirements did not install (see above)" >&2; exit 1; }
echo "setup_env: installing megatron_zero (editable) and building csrc/" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
"$venv/bin/python" -c "import megatron_zero" \
    || { echo "setup_env: megatron_zero did not install (see above)" >&2; exit 1; }
echo "$want" > "$stamp"
