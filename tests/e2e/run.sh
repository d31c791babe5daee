#!/usr/bin/env bash
# The end-to-end suite as tests/run-all.sh and tests/asan-e2e.sh run it: first in WORKERS
# processes side by side (pytest-xdist, each test to the next free worker; a module's fixtures
# start once in each worker that runs its tests), then the tests marked `serial` one at a time with
# nothing beside them: they load the machine on purpose and their callers' deadlines assume the
# cores are theirs (conftest.py). Most of the suite waits on daemons, timers and sockets (on CI's
# two cores one process kept 0.6 of a core busy), so two workers there take the e2e stage from
# about 285 s to about 165, and the asan stage's suite from about 345 s to about 210. (A file a
# worker was slower: the longest files ran last.)
#
#   tests/e2e/run.sh [PYTEST ARGS...]     e.g. tests/e2e/run.sh -x -k forward
#
# Environment: MOED_BUILD_DIR (the build the suite runs, conftest.py), WORKERS (default: the number
# of cores; 1 runs the whole suite in this process, in order). PYTEST ARGS go to both parts; a part
# they leave without a test is not a failure.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
PY=.venv/bin/python
workers=${WORKERS:-$(nproc)}
common=(-q -rfEsxX -p no:cacheprovider tests/e2e)
[ "$workers" -gt 1 ] || exec "$PY" -m pytest "${common[@]}" "$@"

"$PY" -m pytest "${common[@]}" -n "$workers" --dist load -m "not serial" "$@"
side_by_side=$?
"$PY" -m pytest "${common[@]}" -m serial "$@"
alone=$?
# pytest's 5: no test collected
for rc in $side_by_side $alone; do
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"
done
[ "$side_by_side" -eq 5 ] && [ "$alone" -eq 5 ] && exit 5
exit 0
