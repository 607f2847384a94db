#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh                 the default run: every test not marked `slow`
#   bash scripts/test.sh --all           everything, the slow tier included
#   bash scripts/test.sh -m slow         the slow tier alone (any -m of yours replaces the default's)
#   ATEN_CPU_CAPABILITY=avx2 bash scripts/test.sh -m isa
#                                        the fp32 parity subset (marker `isa`: a representative test of each
#                                        tolerance in megatron_zero/testing/tolerances.py) under another vector
#                                        ISA (default, avx2, avx512); fp32 results change with the ISA, the
#                                        tolerances must not. .ci/run does this for default and avx2.
# Fails when a test fails and when no test ran (pytest's exit code 5).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh --test || exit 1
args=()
select=(-m "not slow")
for a in "$@"; do
    case "$a" in
        --all) select=() ;;
        -m|-m=*|-m*) select=(); args+=("$a") ;;
        *) args+=("$a") ;;
    esac
done
.venv/bin/python -m pytest -q -p no:cacheprovider "${select[@]}" "${args[@]}"  # no path: testpaths (tests/)
rc=$?
if [ $rc -eq 5 ]; then
    echo "test.sh: pytest ran no tests (tests marked slow run only with --all or -m); that is a failure" >&2
    exit 1
fi
exit $rc
