#!/usr/bin/env bash
# Create .venv in the repository and install megatron_zero into it (editable),
# building csrc/ where a compiler is present. A second run with nothing changed
# returns in well under a second: a stamp records what was installed.
#   bash scripts/setup_env.sh          what training needs (requirements.txt)
#   bash scripts/setup_env.sh --test   also the peers the tests compare against (requirements-test.txt)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
reqs=requirements.txt
[ "${1:-}" = "--test" ] && reqs=requirements-test.txt
stamp="$venv/.megatron_zero_installed.${reqs%.txt}"
want="$(cat $reqs requirements.txt setup.py $(find csrc -type f 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install() {  # pip's own exit status decides; its noise about this machine's local indexes is dropped
    local log rc
    log=$(mktemp)
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1
    rc=$?
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    return $rc
}
echo "setup_env: installing $reqs into $venv" >&2
pip_install -r "$reqs" || { echo "setup_env: pip could not install $reqs (see above)" >&2; exit 1; }
echo "setup_env: installing megatron_zero (editable) and building csrc/" >&2
pip_install --no-build-isolation --no-deps -e . \
    || { echo "setup_env: pip could not install megatron_zero (see above)" >&2; exit 1; }
echo "$want" > "$stamp"
