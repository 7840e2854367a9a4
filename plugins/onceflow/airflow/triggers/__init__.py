"""onceflow's triggers, run by Airflow's triggerer: a deferred commit waiting for its turn
(commit_turn.py), and the source watcher of a pipeline that keeps up (source_watch.py). A
trigger's classpath stays ``onceflow.airflow.triggers.NAME``: commits deferred before an
upgrade resume after it."""

from onceflow.airflow.triggers.commit_turn import CommitTurnTrigger, TurnListener, look_for_turn
from onceflow.airflow.triggers.source_watch import SourceWatchTrigger

__all__ = ["CommitTurnTrigger", "SourceWatchTrigger", "TurnListener", "look_for_turn"]
