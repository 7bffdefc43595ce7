#!/usr/bin/env bash
# Set up everything on a fresh Debian/Ubuntu machine, then run the main job or the tests.
#   bash ops/quickstart.sh run [diloco run flags...]   # the demo: embedded Redis, syncer, learners
#   bash ops/quickstart.sh test [pytest flags...]      # the test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-run}"; shift || true

SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v python3 >/dev/null || need_apt+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
# the syncer's merge kernels are C and the learners' attention kernel C++, built on first use
# (without a compiler: numpy for the merge, XLA's operations for attention; both slower)
command -v cc >/dev/null || command -v gcc >/dev/null || need_apt+=(gcc libc6-dev)
command -v c++ >/dev/null || command -v g++ >/dev/null || need_apt+=(g++)
# diloco lab (and its tests, as root): network namespaces, veth links and tc shaping
{ command -v ip >/dev/null && command -v tc >/dev/null; } || need_apt+=(iproute2)
# the tests: the dashboard's page is checked in a real headless Chromium (the test fails
# without it when started from here)
if [ "$what" = test ]; then
  export REQUIRE_CHROMIUM=1
  { command -v chromium >/dev/null && command -v chromedriver >/dev/null; } ||
    need_apt+=(chromium chromium-driver)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]} with apt-get" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# redis-server from apt starts a system service; the project never uses it (it starts its own).

PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  python3 -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -e ".[test]"
  touch "$stamp"
fi
# the compiled kernels, built once into ~/.cache/diloco (the processes would build them at their
# first start otherwise: several learners starting at once would each run the compilers)
.venv/bin/diloco build-kernels || true

case "$what" in
  run)  exec .venv/bin/diloco run "$@" ;;
  test)
    # on every core up to 4 (pytest-xdist; most tests wait on the processes they start):
    # DILOCO_TEST_WORKERS=1 runs them one at a time, and -n on the command line wins
    workers="${DILOCO_TEST_WORKERS:-$(nproc)}"; [ "$workers" -gt 4 ] && workers=4
    unset DILOCO_TEST_WORKERS  # not a setting of the code under test
    par=(); if [ "$workers" -gt 1 ] && [[ " $* " != *" -n "* ]] && [[ " $* " != *" -n"[0-9]* ]]
    then par=(-n "$workers" --dist worksteal); fi
    exec .venv/bin/python -m pytest "${par[@]}" "$@" ;;
  *)    echo "usage: $0 run|test [args...]" >&2; exit 2 ;;
esac
