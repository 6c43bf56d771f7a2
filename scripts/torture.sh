#!/usr/bin/env bash
# The long crash and corruption run (issue: "Prove it"), outside the test
# command.  One guest boot runs the torture tests with TRIALS trials each:
#   - log replay (test_torture_logwrites), every crash point: TRIALS raw
#     workloads, TRIALS ext4 and TRIALS XFS workloads with 40 files;
#   - random power cuts (test_torture_power): TRIALS cuts (at least 5);
#   - metadata corruption (test_torture_corrupt): 8 x TRIALS damaged copies
#     (at least 24);
#   - generated bad table lines and messages: 40 x TRIALS;
#   - the fixed power-cut and fault tests (test_crash, test_faults).
# Usage: scripts/torture.sh [TRIALS]   (default 4; make torture TRIALS=N)
# One trial takes about 35 min under TCG on 2 cores.
# Every test's per-test time limit scales with TRIALS.  Results: tests/out/torture.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRIALS=${1:-${TRIALS:-4}}
case $TRIALS in ''|*[!0-9]*|0) echo "torture: TRIALS must be a positive number" >&2; exit 16 ;; esac
export DD_TORTURE_TRIALS=$TRIALS
export DD_TEST_TIMEOUT=$(( 1800 + TRIALS * 240 ))
export GUEST_TIMEOUT=$(( 1800 + TRIALS * 2400 ))
export DEDUP_TEST_OUT=${DEDUP_TEST_OUT:-$REPO/tests/out/torture}
export SKIP_HOST=1
export PYTEST_ARGS="-k 'torture or generated or test_crash or test_faults' -s"
echo "torture: $TRIALS trials per test, guest limit ${GUEST_TIMEOUT}s"
rc=0
"$REPO/tests/run-all.sh" || rc=$?
grep -hE '^(log-writes|random power cuts|corruption campaign|generated)' \
    "$DEDUP_TEST_OUT/pytest.log" || true
exit $rc
