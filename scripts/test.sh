#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite. Extra arguments go to pytest
# (e.g. `bash scripts/test.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The dashboard tests drive a real headless Chromium (Debian's, with its chromedriver) and
# run the Grafana dashboard's queries on a real Prometheus (Debian's).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null || [[ ! -x /usr/bin/prometheus ]]; then
  echo "[test] installing chromium, chromium-driver and prometheus (apt)"
  SUDO=$([[ $(id -u) -eq 0 ]] && echo "" || echo "sudo")
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q chromium chromium-driver prometheus >/dev/null
  # Debian starts a system-wide Prometheus where systemd runs; the tests start their own.
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
bash scripts/fetch-helm.sh  # the chart's tests run a real helm
# Two shared cores: one OpenMP thread per process, and no spin-waiting.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
# Three pytest workers (PAGEFLEET_TEST_WORKERS; 0 runs in this process): much of the suite
# waits on servers starting and answering, so three keep two cores busy (two left a fifth of
# the CPU idle; in one afternoon the suite took 1105 s with two and 694 s with three, on a
# machine itself about a quarter faster for the second run). A module runs whole on one
# worker (--dist loadscope), so its fleet fixture starts once.
# Tests marked `alone` run afterwards, with the machine to themselves.
workers=${PAGEFLEET_TEST_WORKERS:-3}
if [[ $workers == 0 ]]; then
  exec .venv/bin/python -m pytest "$@"
fi
status=0
ran() { [[ $1 == 0 || $1 == 5 ]] || status=$1; }  # 5: this phase selected no test
.venv/bin/python -m pytest -n "$workers" --dist loadscope -m "not alone" "$@" && ran 0 || ran $?
.venv/bin/python -m pytest -m alone "$@" && ran 0 || ran $?
exit $status
