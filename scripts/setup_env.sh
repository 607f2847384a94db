#!/usr/bin/env bash
# Create .venv in the repository and install megatron_zero into it (editable),
# building csrc/ where a compiler is present. A second run with nothing changed
# returns in well under a second: a stamp records what was installed.
#   bash scripts/setup_env.sh          what training needs (requirements.txt)
#   bash scripts/setup_env.sh --demo   also matplotlib, which draws the main job's loss curve (requirements-demo.txt)
#   bash scripts/setup_env.sh --test   also the peers the tests compare against and the optional tiktoken
#                                      (requirements-test.txt, which includes requirements.txt: after it, a
#                                      plain set-up has nothing to do)
# The stamp ($venv/.megatron_zero_installed.<requirements file>) holds a hash of the requirements, setup.py and
# csrc/ as installed. Every stamp is removed before an install starts and the new one is written last (tmp +
# rename), so a set-up stopped part way (SIGTERM, Ctrl-C, a pip failure) leaves none: the next run installs again.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
reqs=requirements.txt
[ "${1:-}" = "--test" ] && reqs=requirements-test.txt
[ "${1:-}" = "--demo" ] && reqs=requirements-demo.txt
stamp_of() { echo "$venv/.megatron_zero_installed.${1%.txt}"; }
hash_of() { cat "$1" requirements.txt setup.py $(find csrc -type f 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -d' ' -f1; }
covering=("$reqs")  # the installs that cover this one: itself; the test set covers the others, the demo's the plain one
[ "$reqs" != requirements-test.txt ] && covering+=(requirements-test.txt)
[ "$reqs" = requirements.txt ] && covering+=(requirements-demo.txt)
if [ -x "$venv/bin/python" ]; then
    for r in "${covering[@]}"; do
        [ -f "$(stamp_of "$r")" ] && [ "$(cat "$(stamp_of "$r")")" = "$(hash_of "$r")" ] && exit 0
    done
fi
want="$(hash_of "$reqs")"
rm -f "$venv"/.megatron_zero_installed.*  # from here until the end, what the venv holds is vouched for by nothing
python=${PYTHON:-python3}
# a venv whose creation was stopped part way has no working pip: made anew
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$python" -m venv --clear "$venv" \
    || { echo "setup_env: $python could not create the virtual environment $venv" >&2; exit 1; }
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
if [ "$reqs" = requirements-test.txt ]; then  # Muon's test reference declares Python >= 3.12 and runs on 3.11
    eo="$(grep -o '^emerging-optimizers==[0-9.]*' requirements-test.txt)"
    "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
        || pip_install --no-deps --ignore-requires-python "$eo" || { echo "setup_env: pip could not install $eo" >&2; exit 1; }
fi
echo "setup_env: installing megatron_zero (editable) and building csrc/" >&2
pip_install --no-build-isolation --no-deps -e . \
    || { echo "setup_env: pip could not install megatron_zero (see above)" >&2; exit 1; }
stamp="$(stamp_of "$reqs")"
echo "$want" > "$stamp.tmp.$$" && mv -f "$stamp.tmp.$$" "$stamp"
