#!/usr/bin/env bash
# onceflow's entry points on a fresh machine (Debian/Ubuntu, Python 3.11, Java 17):
#
#   bash run.sh demo    the tweets example end to end (PostgreSQL found or started, Airflow
#                       DAG, Spark local mode), then the commit log and an independent check;
#                       non-zero if the check fails (`bash run.sh demo --help`)
#   bash run.sh demo orders   the orders example (typed state, append and upsert tables,
#                       concurrent writers; `bash run.sh demo orders --help`)
#   bash run.sh test    the whole test suite (pytest; extra arguments go to pytest)
#   bash run.sh ui      the Airflow UI on http://127.0.0.1:8080 (airflow standalone)
#   bash run.sh onceflow ARGS...   any `onceflow` command inside the project's environment
#
# Each bootstraps what it needs, idempotently: a virtualenv in .venv with the locked
# dependencies (constraints.txt), onceflow and its examples (re-installed only when a pyproject.toml changes).
# Set PYTHON to choose the interpreter (default python3.11, else python3).
set -euo pipefail
cd "$(dirname "$0")"
root=$(pwd)

python=${PYTHON:-$(command -v python3.11 || command -v python3)}
venv="$root/.venv"
stamp="$venv/.onceflow-installed"
want=$(cat pyproject.toml constraints.txt examples/*/pyproject.toml | sha256sum | cut -d' ' -f1)

if [ ! -x "$venv/bin/python" ]; then
  echo "onceflow: creating the virtualenv in .venv ($("$python" --version))" >&2
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "onceflow: installing onceflow and the locked dependencies (constraints.txt) into .venv (a few minutes the first time)" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
  examples=()
  for example in examples/*/pyproject.toml; do examples+=(-e "$(dirname "$example")"); done
  "$venv/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt \
    -e ".[spark,redis,test]" "${examples[@]}"
  echo "$want" > "$stamp"
fi
need_java() {
  if ! command -v java >/dev/null 2>&1; then
    echo "onceflow: Java is missing: Spark needs a JDK 17 (Debian: apt-get install openjdk-17-jdk-headless)" >&2
    exit 2
  fi
}

export PATH="$venv/bin:$PATH"
export ONCEFLOW_HOME="$root"
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    need_java
    if [ "${1:-}" = orders ]; then shift; exec orders-demo "$@"; fi
    exec tweets-demo "$@" ;;
  test) need_java; exec python -m pytest "$@" ;;
  ui) exec onceflow ui "$@" ;;
  onceflow) exec onceflow "$@" ;;
  *) echo "usage: bash run.sh demo|test|ui|onceflow ARGS (see the top of run.sh)" >&2; exit 2 ;;
esac
