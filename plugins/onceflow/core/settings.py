"""onceflow's settings: every one it reads, in one registry, read in one place.

A setting ``key`` is the environment variable ``ONCEFLOW_<KEY>``. The ones Airflow's processes
use (``airflow=True``) are also options of Airflow's configuration section ``[onceflow]``
(airflow.cfg, ``AIRFLOW__ONCEFLOW__<KEY>``; onceflow's provider declares them, so Airflow's
config view lists them). A value is read when asked, in this order: the environment variable;
for an Airflow option, Airflow's configuration where this process has already loaded it; the
default. docs/configuration.md is the table of them (a test holds the two equal).

A value that cannot be read is a ConfigError naming where it came from, the value and what the
setting takes: a typo must never leave a setting silently at its default.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from onceflow.core.errors import ConfigError

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
SECTION = "onceflow"  # Airflow's configuration section of the Airflow options


@dataclass(frozen=True)
class Setting:
    """One setting. ``kind``: string, integer, float or boolean (the types of Airflow's
    provider configuration); ``minimum``/``maximum``/``choices`` bound its values and
    ``takes`` says what it takes in an error; ``shown_default`` is the default as the docs
    give it, where the default is not a fixed value (None: ``default``)."""

    key: str
    kind: str
    default: Any
    description: str
    airflow: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    takes: str = ""
    shown_default: str | None = None
    example: str | None = None

    @property
    def env(self) -> str:
        return "ONCEFLOW_" + self.key.upper()

    @property
    def airflow_env(self) -> str:
        return f"AIRFLOW__{SECTION.upper()}__{self.key.upper()}"

    def default_text(self) -> str:
        """The default as the docs and Airflow's config view show it."""
        if self.shown_default is not None:
            return self.shown_default
        if self.kind == "boolean":
            return "true" if self.default else "false"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return "" if self.default is None else str(self.default)

    def parse(self, raw: str, where: str) -> Any:
        """``raw`` as this setting's value; a ConfigError naming ``where`` (the variable or
        the option), the value and what it takes."""
        value = raw.strip()
        if self.kind == "boolean":
            if value.lower() in ON or value.lower() in OFF:
                return value.lower() in ON
            raise ConfigError(f"{where}={raw!r} is not an on/off value: set it to one of "
                              f"{', '.join(ON)} or {', '.join(OFF)}, or unset it")
        if self.kind == "string":
            if self.choices and value not in self.choices:
                self._refuse(raw, where, f"choose one of {', '.join(self.choices)}")
            return value
        number: float | None = None
        try:
            number = int(value) if self.kind == "integer" else float(value)
        except ValueError:
            pass
        if number is None or number != number or (  # NaN is not a number of seconds
                self.minimum is not None and number < self.minimum) or (
                self.maximum is not None and number > self.maximum):
            self._refuse(raw, where, self.takes or f"give a {self.kind}")
        return number

    def _refuse(self, raw: str, where: str, takes: str) -> None:
        default = self.default_text()
        unset = f", or unset it for the default ({default})" if default else ""
        raise ConfigError(f"{where}={raw!r} is invalid: {takes}{unset}")


def _s(key: str, kind: str, default: Any, description: str, **more: Any) -> Setting:
    return Setting(key, kind, default, description, **more)


_SECONDS = "give a number of seconds, 0 or more"
_PORT = "give a port number from 1 to 65535"

REGISTRY: tuple[Setting, ...] = (
    _s("pg_dsn", "string", None,
       "The coordinator's PostgreSQL for the CLI, the tests and the Spark driver (a libpq "
       "DSN). Airflow's tasks use the connection onceflow_pg, and this where Airflow has no "
       "such connection.",
       shown_default="postgresql://postgres@127.0.0.1:5432/onceflow",
       example="postgresql://user:pass@host:5432/onceflow"),
    _s("pipelines", "string", "",
       "module:attribute references of pipelines besides the onceflow.pipelines entry "
       "points, comma-separated (the same in every process: Airflow's, Spark's, the "
       "CLI).", shown_default="none",
       example="my_pipelines.orders:pipeline"),
    _s("home", "string", None,
       "The folder of onceflow's local files (.airflow/, .pgdata/, .run/).",
       shown_default="the current directory (run.sh: the project folder)"),
    _s("segments_dir", "string", None,
       "The root folder of file segments declared without a path; on a cluster a folder "
       "every worker sees.", shown_default="$ONCEFLOW_HOME/.run/segments"),
    _s("spark", "string", "connect",
       "How run.sh demo and ui run Spark: connect starts the local Spark Connect server, "
       "submit runs spark-submit for each batch.", choices=("connect", "submit")),
    _s("spark_connect_port", "integer", 15002,
       "The port of the local Spark Connect server onceflow starts.", minimum=1,
       maximum=65535, takes=_PORT),
    _s("spark_master", "string", "local[2]",
       "The master of the Spark sessions onceflow starts itself (a local session, the local "
       "Connect server); spark-submit's is its connection's."),
    _s("driver_memory", "string", "2g",
       "The driver memory of the same Spark sessions."),
    _s("shuffle_partitions", "integer", 4,
       "spark.sql.shuffle.partitions of the sessions that process batches.", minimum=1,
       takes="give a whole number of partitions, 1 or more"),
    _s("jvm_reader", "boolean", True,
       "Read landing-folder JSON lines with onceflow's JVM reader; false: Python workers "
       "read them (the same rows, more CPU)."),
    _s("pg_port", "integer", 54329,
       "The port of the private PostgreSQL cluster run.sh starts when no server answers.",
       minimum=1, maximum=65535, takes=_PORT),
    _s("retry_delay_seconds", "float", 10.0,
       "The delay before Airflow retries a task of onceflow's DAGs.", airflow=True,
       minimum=0, takes=_SECONDS),
    _s("attempt_lease_s", "integer", 60,
       "How long a transaction attempt's holder may stay silent before the next run adopts "
       "its txid (a pipeline's attempt_lease_s wins).", airflow=True, minimum=1,
       takes="give a positive whole number of seconds"),
    _s("spark_connect_retry_s", "float", 30.0,
       "How long a Spark Connect client retries a server that is gone before the task fails "
       "(and Airflow retries it).", airflow=True, minimum=0, takes=_SECONDS),
    _s("pg_connect_retry_s", "float", 30.0,
       "How long connecting to PostgreSQL is tried again while the server refuses "
       "connections, is starting up or is in recovery (a restart), with a backoff and a "
       "log line per try, before the task fails (and Airflow retries it); 0: one try.",
       airflow=True, minimum=0, takes=_SECONDS),
    _s("begin_wait_s", "float", 300.0,
       "How long a run past a pipeline's max_pending waits in begin for a commit before it "
       "ends skipped (0: at once).", airflow=True, minimum=0, takes=_SECONDS),
)

SETTINGS: dict[str, Setting] = {s.key: s for s in REGISTRY}


def env_name(key: str) -> str:
    """The environment variable of setting ``key`` (for messages and child processes)."""
    return SETTINGS[key].env


def get(key: str) -> Any:
    """Setting ``key``'s value: its environment variable, else (an Airflow option) Airflow's
    configuration where this process has loaded it, else its default. An empty variable is
    unset."""
    setting = SETTINGS[key]
    raw = os.environ.get(setting.env, "")
    if raw.strip():
        return setting.parse(raw, setting.env)
    if setting.airflow:
        raw = _airflow_option(setting) or ""
        if raw.strip():
            return setting.parse(raw, f"[{SECTION}] {key} (airflow.cfg or "
                                      f"{setting.airflow_env})")
    return setting.default


def _airflow_option(setting: Setting) -> str | None:
    """The option in Airflow's configuration, only where this process has loaded it already:
    the CLI and the Spark side must not start Airflow to read a setting."""
    if "airflow.configuration" not in sys.modules:
        return None
    # imported here: loaded already (checked above); a module-level import would load Airflow
    from airflow.configuration import conf

    value = conf.get(SECTION, setting.key, fallback=None)
    return None if value is None else str(value)
