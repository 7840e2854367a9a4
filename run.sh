#!/usr/bin/env bash
# onceflow's entry points on a fresh machine (Debian/Ubuntu, Python 3.11, Java 17):
#
#   bash run.sh demo    the tweets example end to end (PostgreSQL found or started, Airflow
#                       DAG, Spark local mode), then the commit log and an independent check;
#                       non-zero if the check fails (`bash run.sh demo --help`)
#   bash run.sh demo orders   the orders example (typed state, append and upsert tables,
#                       concurrent writers; `bash run.sh demo orders --help`)
#   bash run.sh demo ui | demo onceflow ARGS...   the UI or any `onceflow` command with the
#                       examples' pipelines registered
#   bash run.sh test    the whole test suite (pytest; extra arguments go to pytest)
#   bash run.sh bench SCRIPT ARGS...   a benchmark (bench/SCRIPT.py) with the examples'
#                       pipelines registered (bench/README.md)
#   bash run.sh ui      the Airflow UI on http://127.0.0.1:8080 (airflow standalone)
#   bash run.sh onceflow ARGS...   any `onceflow` command inside the project's environment
#
# Each bootstraps what it needs, idempotently: a virtualenv in .venv with the locked
# dependencies (constraints.txt) and onceflow (re-installed only when its build inputs change:
# the pyproject.toml files, setup.py, the lock, the JVM reader's Java sources). The examples
# are installed off the virtualenv's path, in .venv/examples: only `demo` and the tests
# register them, so `ui` and `onceflow` show your pipelines alone.
# Set PYTHON to choose the interpreter (default python3.11, else python3).
set -euo pipefail
cd "$(dirname "$0")"
root=$(pwd)

python=${PYTHON:-$(command -v python3.11 || command -v python3)}
venv="$root/.venv"
stamp="$venv/.onceflow-installed"
want=$(cat pyproject.toml setup.py MANIFEST.in constraints.txt examples/*/pyproject.toml \
  spark_tasks/java/onceflow/spark/*.java | sha256sum | cut -d' ' -f1)

javac_or_exit() {
  if ! command -v javac >/dev/null 2>&1 && [ ! -x "${JAVA_HOME:-/nonexistent}/bin/javac" ]; then
    echo "onceflow: javac is missing: installing onceflow compiles its JVM reader, and Spark needs a JDK 17 (Debian: apt-get install openjdk-17-jdk-headless)" >&2
    exit 2
  fi
}

if [ ! -x "$venv/bin/python" ]; then
  echo "onceflow: creating the virtualenv in .venv ($("$python" --version))" >&2
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  javac_or_exit
  echo "onceflow: installing onceflow and the locked dependencies (constraints.txt) into .venv (a few minutes the first time)" >&2
  pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
  "${pip[@]}" install --upgrade pip
  # The build's own requirements first: setup.py compiles the JVM reader against this
  # pyspark, the one the environment runs (--no-build-isolation: no second copy of it).
  "${pip[@]}" install -c constraints.txt setuptools pyspark
  # Examples installed into the environment by an older run.sh would register everywhere.
  "${pip[@]}" uninstall --yes onceflow-example-tweets onceflow-example-orders 2>/dev/null || true
  "${pip[@]}" install --no-build-isolation -c constraints.txt -e ".[redis,kafka]" --group test
  examples=()
  for example in examples/*/pyproject.toml; do examples+=(-e "$(dirname "$example")"); done
  rm -rf "$venv/examples"
  "${pip[@]}" install --no-build-isolation --no-deps --target "$venv/examples" "${examples[@]}"
  echo "$want" > "$stamp"
fi
need_java() {
  if ! command -v java >/dev/null 2>&1; then
    echo "onceflow: Java is missing: Spark needs a JDK 17 (Debian: apt-get install openjdk-17-jdk-headless)" >&2
    exit 2
  fi
}
# The examples' folders, and .venv/examples with their installed metadata (their entry
# points), on the path of this command and of every process it starts.
with_examples() {
  local paths=()
  for example in examples/*/pyproject.toml; do paths+=("$root/$(dirname "$example")"); done
  paths+=("$venv/examples")
  PYTHONPATH="$(IFS=:; echo "${paths[*]}")${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
}

export PATH="$venv/bin:$PATH"
export ONCEFLOW_HOME="$root"
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    with_examples
    case "${1:-}" in
      ui) shift; exec onceflow ui "$@" ;;
      onceflow) shift; exec onceflow "$@" ;;
      orders) shift; need_java; exec python -m orders_example.demo "$@" ;;
      *) need_java; exec python -m tweets_example.demo "$@" ;;
    esac ;;
  test) need_java; exec python -m pytest "$@" ;;
  bench)
    if [ $# -eq 0 ]; then echo "usage: bash run.sh bench SCRIPT ARGS (the scripts: bench/README.md)" >&2; exit 2; fi
    script=${1%.py}; shift
    if [ ! -f "bench/$script.py" ]; then echo "onceflow: no benchmark bench/$script.py (the scripts: bench/README.md)" >&2; exit 2; fi
    with_examples; need_java; exec python "bench/$script.py" "$@" ;;
  ui) exec onceflow ui "$@" ;;
  onceflow) exec onceflow "$@" ;;
  *) echo "usage: bash run.sh demo|test|bench|ui|onceflow ARGS (see the top of run.sh)" >&2; exit 2 ;;
esac
