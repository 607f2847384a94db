#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest.
# Fails when a test fails and when no test ran (pytest's exit code 5).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh --test || exit 1
.venv/bin/python -m pytest -q -p no:cacheprovider "${@:-tests}"
rc=$?
if [ $rc -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit $rc
