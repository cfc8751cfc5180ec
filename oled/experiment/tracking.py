"""MLflow tracking through `MlflowClient`: runs, nested runs, params, metrics, artifacts."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from oled.recipe import Recipe

BATCH = 900  # MLflow accepts at most 1000 metrics and 100 params per log_batch


def default_tracking_uri() -> str:
    """`sqlite:///<cwd>/mlflow.db` with an absolute path."""
    return f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"


def git_commit(cwd: Path | None = None) -> str | None:
    """The current git commit of `cwd`, if it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class Tracker:
    """One MLflow run."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """One value per key, the runs table's and the compare view's columns (values that
        are not numbers, such as None, are skipped); series go into artifacts, not steps."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, 0) for k, v in metrics.items() if isinstance(v, (int, float))
        ]
        for first in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, metrics=items[first : first + BATCH])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            if value is not None:
                self.client.set_tag(self.run_id, key, str(value))

    def log_artifacts(self, paths: Sequence[Path], artifact_path: str | None = None) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_recipe(self, recipe: Recipe) -> None:
        """The recipe's file (if it has one) under the artifact folder `recipe`."""
        if recipe.path is not None:
            self.log_artifacts([recipe.path], "recipe")


class NullTracker(Tracker):
    """Tracking switched off: every call does nothing."""

    def __init__(self) -> None:
        super().__init__(None, "")

    def log_params(self, params: dict[str, str]) -> None: ...

    def log_metrics(self, metrics: dict[str, Any]) -> None: ...

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def log_artifacts(self, paths: Sequence[Path], artifact_path: str | None = None) -> None: ...


QUIET_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration")  # a new store's set-up


def client_for(uri: str) -> Any:
    """An `MlflowClient` for `uri` (the INFO lines of a new store's tables are not shown)."""
    import logging

    from mlflow.tracking import MlflowClient

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def open_store(uri: str) -> Any:
    """An `MlflowClient` for `uri` whose store answers; an OSError naming the store when it
    cannot be opened (a sqlite file in a folder that is missing or not writable, a server that
    does not answer), so that the failure is one line before any work."""
    try:
        client = client_for(uri)
        client.search_experiments(max_results=1)
    except Exception as exc:  # mlflow and sqlalchemy raise their own types
        reason = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise OSError(f"cannot open the MLflow store {uri}: {reason.strip()}") from None
    return client


def check_store(recipe: Recipe) -> None:
    """Open the recipe's MLflow store now, when tracking is on (see open_store)."""
    if recipe.tracking.mlflow:
        open_store(recipe.tracking.tracking_uri or default_tracking_uri())


def experiment_id(client: Any, name: str, uri: str) -> str:
    """Id of experiment `name`, created if needed (artifacts beside a sqlite store)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri.removeprefix("sqlite:///")).parent / "mlruns").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created meanwhile by another process
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


@contextmanager
def tracked_run(
    recipe: Recipe,
    *,
    run_name: str | None = None,
    parent: Tracker | None = None,
    tags: dict[str, Any] | None = None,
) -> Iterator[Tracker]:
    """An MLflow run that ends FINISHED, or FAILED (KILLED on Ctrl-C) if the body raises."""
    if not recipe.tracking.mlflow:
        yield NullTracker()
        return
    uri = recipe.tracking.tracking_uri or default_tracking_uri()
    client = client_for(uri)  # the commands opened the store once before any work (check_store)
    all_tags = {
        "oled.recipe": recipe.name,
        "oled.recipe_hash": recipe.hash(),
        "oled.device": recipe.runtime.device,
        "mlflow.source.git.commit": git_commit(),
        "mlflow.parentRunId": parent.run_id if parent else None,
        **(tags or {}),
    }
    run = client.create_run(
        experiment_id(client, recipe.tracking.experiment, uri),
        run_name=run_name or recipe.name,
        tags={k: str(v) for k, v in all_tags.items() if v is not None},
    )
    tracker = Tracker(client, run.info.run_id)
    try:
        yield tracker
    except KeyboardInterrupt:
        client.set_terminated(tracker.run_id, "KILLED")
        raise
    except BaseException:
        client.set_terminated(tracker.run_id, "FAILED")
        raise
    client.set_terminated(tracker.run_id, "FINISHED")
