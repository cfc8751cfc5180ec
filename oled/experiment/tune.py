"""`oled tune`: an Optuna study over `[tune.params]`, one nested MLflow run per trial.

The objective is a registered component (kind `objective`): a callable taking a candidate
recipe and returning a dict of metrics; `[tune] metric` picks the one to optimise. What can be
checked is checked before any trial runs (the storage opens, `out` can be written); a finished
study is never lost: it is in its storage, and the best recipe is written to the study's report
folder before `out`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from oled import registry as reg
from oled.experiment.tracking import Tracker, check_store, tracked_run
from oled.recipe import Recipe, SearchSpace, load_recipe
from oled.recipe.schema import TuneSection

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Objective = Callable[[Recipe], dict[str, float]]

HEARTBEAT_INTERVAL = 60  # seconds between a running trial's heartbeats (database storages)
JOURNAL = "journal:"
OPEN_ATTEMPTS = 5  # tries to open a database storage that other workers are creating


@dataclass
class TuneResult:
    """The best trial of a study, and the folder of this process's study report."""

    study_name: str
    value: float
    params: dict[str, Any]
    recipe: Recipe
    report_dir: Path | None = None


class StorageError(ValueError):
    """The study's storage cannot be opened."""


class ResultNotWritten(OSError):
    """The study finished but `out` could not be written; `result` is its best trial."""

    def __init__(self, message: str, result: TuneResult) -> None:
        super().__init__(message)
        self.result = result


@reg.component("objective", "simulate")
def simulate_objective(recipe: Recipe) -> dict[str, float]:
    """Replay `[tune] trace` through the recipe's policies in the simulator."""
    from oled.experiment.simulate import simulate_recipe
    from oled.trace.format import Trace

    assert recipe.tune is not None
    if recipe.tune.trace is None:
        raise ValueError("objective 'simulate' needs [tune] trace = PATH (a recorded trace)")
    from oled.recipe import beside

    result, bound = simulate_recipe(Trace.load(beside(recipe.tune.trace, recipe.folder)), recipe)
    out = {k: float(v) for k, v in result.to_dict().items() if isinstance(v, (int, float))}
    return out | {"belady_bound": bound}


@reg.component("objective", "run")
def run_objective(recipe: Recipe) -> dict[str, float]:
    """Real generations through `oled.build` (replays of `workload.routing`'s trace when it
    names one): the run's summary figures."""
    from oled.experiment.report import summarize
    from oled.experiment.run import load_workload, run_loaded
    from oled.runtime import build

    work = load_workload(recipe)
    summary = summarize(run_loaded(build(recipe), recipe, work))
    return {k: float(v) for k, v in summary.items() if isinstance(v, (int, float))}


def storage_url(url: str | None) -> str:
    """`url`, or by default `sqlite:///<cwd>/optuna.db` with an absolute path."""
    return url or f"sqlite:///{(Path.cwd() / 'optuna.db').resolve()}"


def describe_storage(url: str | None) -> str:
    """The storage as it may be printed: a database URL without its password."""
    url = storage_url(url)
    if url.startswith(JOURNAL):
        return url
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def storage_for(
    url: str | None,
    heartbeat_interval: int | None = HEARTBEAT_INTERVAL,
    grace_period: int | None = None,
) -> Any:
    """An Optuna storage: `journal:PATH` (a journal file) or a database URL (sqlite in the cwd
    by default). On a database a running trial records a heartbeat every `heartbeat_interval`
    seconds (None or 0: none), and one silent for `grace_period` seconds (default twice the
    interval) is marked FAIL by the next trial any worker starts."""
    import optuna

    url = storage_url(url)
    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix(JOURNAL)))
    with warnings.catch_warnings():  # heartbeats are an experimental argument of Optuna's
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=heartbeat_interval or None, grace_period=grace_period or None
        )


def open_study(
    tune: TuneSection, name: str, heartbeat_interval: int | None, grace_period: int | None
) -> Any:
    """Create the study, or load it if it exists; StorageError, naming the storage, if the
    storage cannot be opened. Workers that create a new database's tables at the same moment
    conflict (a duplicate key, type or table): the one that lost tries again (OPEN_ATTEMPTS in
    all)."""
    import optuna
    from sqlalchemy.exc import IntegrityError, ProgrammingError, SQLAlchemyError

    attempt = 1
    while True:
        try:
            return optuna.create_study(
                storage=storage_for(tune.storage, heartbeat_interval, grace_period),
                study_name=name,
                direction=tune.direction,
                load_if_exists=True,
                sampler=optuna.samplers.TPESampler(seed=tune.seed),
            )
        except (OSError, ImportError, SQLAlchemyError) as exc:
            raced = isinstance(exc, (IntegrityError, ProgrammingError))
            if not raced or attempt == OPEN_ATTEMPTS:
                raise StorageError(_cannot_open(tune, exc)) from None
        time.sleep(0.5 * attempt)
        attempt += 1


def study_name(recipe: Recipe) -> str:
    """`tune.study_name`, else the recipe's name and a digest of its search space: two recipes
    of one name that search other keys never share a study, and the same recipe resumes its
    own."""
    tune = recipe.tune
    assert tune is not None
    if tune.study_name:
        return tune.study_name
    space = {key: s.model_dump(by_alias=True) for key, s in sorted(tune.params.items())}
    digest = hashlib.sha1(json.dumps(space, sort_keys=True).encode()).hexdigest()[:8]
    return f"{recipe.name}-{digest}"


def check_space(study: Any, tune: TuneSection) -> None:
    """ValueError when the study's trials tuned keys this recipe does not search (a study
    name given twice for other spaces)."""
    seen = {key for trial in study.trials for key in trial.params}
    other = sorted(seen - set(tune.params))
    if other:
        raise ValueError(
            f"study '{study.study_name}' in {describe_storage(tune.storage)} tuned other keys "
            f"({', '.join(other)}): give this search its own tune.study_name"
        )


def _cannot_open(tune: TuneSection, exc: BaseException) -> str:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"cannot open the study storage {describe_storage(tune.storage)}: {reason}"


def worker_id() -> str:
    """This process as `host:pid`: which worker ran a trial."""
    return f"{socket.gethostname()}:{os.getpid()}"


def suggest(trial: Any, key: str, space: SearchSpace) -> Any:
    """A value of `space` for `key` from an Optuna trial."""
    if space.choices is not None:
        return trial.suggest_categorical(key, space.choices)
    low, high = space.low, space.high
    assert low is not None and high is not None
    if space.int_:
        step = int(space.step or 1)
        return trial.suggest_int(key, int(low), int(high), step=step, log=space.log)
    return trial.suggest_float(key, low, high, step=space.step, log=space.log)


class _TrialFailed(Exception):
    """Marks a nested trial run as failed."""


class TrialLogger:
    """Optuna callback: each finished trial becomes a nested MLflow run of the study's run."""

    def __init__(self, recipe: Recipe, parent: Tracker, on_done: Callable[[], None]) -> None:
        self.recipe = recipe
        self.parent = parent
        self.on_done = on_done

    def __call__(self, study: Any, trial: Any) -> None:
        import optuna

        tags = {
            "oled.study": study.study_name,
            "oled.trial": trial.number,
            "oled.worker": trial.user_attrs.get("worker"),
        }
        try:
            with tracked_run(
                self.recipe.with_values(trial.params),
                run_name=f"{study.study_name}/{trial.number}",
                parent=self.parent,
                tags=tags,
            ) as run:
                run.log_params({f"trial.{k}": str(v) for k, v in trial.params.items()})
                run.log_metrics(trial.user_attrs.get("metrics", {}))
                if trial.state != optuna.trial.TrialState.COMPLETE:
                    raise _TrialFailed  # ends the nested run as FAILED
        except _TrialFailed:
            pass
        self.on_done()


def make_objective(recipe: Recipe, objective: Objective) -> Callable[[Any], float]:
    """Optuna objective: suggest values, validate the candidate recipe, evaluate it."""
    tune = recipe.tune
    assert tune is not None

    def evaluate(trial: Any) -> float:
        trial.set_user_attr("worker", worker_id())
        values = {key: suggest(trial, key, space) for key, space in tune.params.items()}
        metrics = objective(recipe.with_values(values))
        trial.set_user_attr("metrics", {k: float(v) for k, v in metrics.items()})
        if tune.metric not in metrics:
            raise KeyError(f"objective returned no '{tune.metric}' (has {sorted(metrics)})")
        return float(metrics[tune.metric])

    return evaluate


def best_recipe_text(result: TuneResult) -> str:
    """The best recipe as TOML, with a header naming the study."""
    head = f"# Best of study '{result.study_name}': value {result.value!r}\n"
    return (
        head
        + "\n".join(f"#   {k} = {v!r}" for k, v in result.params.items())
        + "\n\n"
        + (result.recipe.to_toml())
    )


def run_trials(
    study: Any, recipe: Recipe, parent: Tracker, trials: int | None, console: Console
) -> None:
    """Run `trials` trials (default: those the study still misses) with a progress bar; each
    finished one is logged as a nested run of `parent`."""
    import optuna

    tune = recipe.tune
    assert tune is not None
    complete = (optuna.trial.TrialState.COMPLETE,)
    todo = trials if trials is not None else tune.trials - len(study.get_trials(states=complete))
    if todo <= 0:
        return
    objective = make_objective(recipe, reg.get("objective", tune.objective))
    columns = (TextColumn("tune {task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(study.study_name, total=todo)
        callbacks: list[Any] = [TrialLogger(recipe, parent, lambda: bar.advance(task))]
        if trials is None:
            callbacks.append(optuna.study.MaxTrialsCallback(tune.trials, states=complete))
        study.optimize(objective, n_trials=todo, callbacks=callbacks)


def study_folder(recipe: Recipe, name: str) -> Path:
    """A new folder `<report_dir>/<study>-<date>-<time>-<random>`, or one in the temporary
    directory where the report directory cannot be written."""
    safe = re.sub(r"[^\w.-]", "_", name)
    prefix = f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-"
    base = Path(recipe.tracking.report_dir)
    try:
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    except OSError:
        return Path(tempfile.mkdtemp(prefix=prefix))


def study_plots(study: Any, folder: Path, console: Console) -> list[Path]:
    """`optimization_history.png` and, with two complete trials or more over tuned
    parameters, `param_importances.png`; a plot that cannot be drawn is named on the console
    with the reason instead."""
    import optuna
    from optuna.visualization import matplotlib as vis

    from oled.experiment.report import pyplot, save_figure

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    plots: dict[str, Callable[[optuna.Study], Axes]] = {
        "optimization_history": vis.plot_optimization_history
    }
    if len(complete) >= 2 and study.best_params:
        plots["param_importances"] = vis.plot_param_importances
    else:
        console.print(
            "no param_importances plot: it needs tuned parameters and two complete trials"
        )
    plt, written = pyplot(), []
    for name, plot in plots.items():
        try:  # Optuna's experimental and few-trials warnings; its style stays in the plot
            with warnings.catch_warnings(), plt.rc_context():
                warnings.simplefilter("ignore")
                axes = plot(study)
        except (ImportError, ValueError, RuntimeError) as exc:
            console.print(f"no {name} plot: {exc}")
            continue
        written.append(save_figure(plt, axes.figure, folder / f"{name}.png"))
    return written


def write_study_report(
    recipe: Recipe, study: Any, result: TuneResult, console: Console
) -> list[Path]:
    """`best.toml` and the study's plots in a new study folder (`result.report_dir`); the
    files written, `best.toml` first."""
    folder = study_folder(recipe, result.study_name)
    best = folder / "best.toml"
    best.write_text(best_recipe_text(result))
    result.report_dir = folder
    return [best, *study_plots(study, folder, console)]


def save_best(result: TuneResult, out: Path, copy: Path, storage: str) -> None:
    """Write the best recipe to `out` and validate it; ResultNotWritten, naming `copy` (the
    report's best.toml) and the study's `storage`, if it cannot be written."""
    try:
        out.write_text(best_recipe_text(result))
    except OSError as exc:
        raise ResultNotWritten(
            f"cannot write {out}: {exc.strerror or exc}; the best recipe is in {copy} instead, "
            f"and the study '{result.study_name}' stays in {storage}",
            result,
        ) from None
    load_recipe(out)  # the written recipe must validate


def tune_recipe(
    recipe: Recipe,
    *,
    trials: int | None = None,
    out: Path | None = None,
    console: Console | None = None,
    heartbeat_interval: int | None = None,
    grace_period: int | None = None,
) -> TuneResult:
    """Run (or resume) the study; trials this process runs default to those still missing.

    Before any trial: the storage must open, and for the `run` objective the model and device
    must be there (else ValueError, OSError or StorageError; `oled tune` checks that `--out` is
    writable first). After: the best recipe and the plots go to a study folder under
    `tracking.report_dir` and to the MLflow study run, then the best recipe to `out`.
    `heartbeat_interval` (seconds; None: HEARTBEAT_INTERVAL, 0: none) and `grace_period`:
    see `storage_for`.
    """
    import optuna

    tune = recipe.tune
    if tune is None:
        raise ValueError("recipe has no [tune] section")
    console = console or Console(stderr=True)
    check_store(recipe)
    if tune.objective == "run":  # real generations: a model or device missing here fails now
        from oled.runtime import check

        check(recipe)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = study_name(recipe)
    beat = HEARTBEAT_INTERVAL if heartbeat_interval is None else heartbeat_interval
    study = open_study(tune, name, beat, grace_period)
    check_space(study, tune)
    storage = describe_storage(tune.storage)
    tags = {"oled.study": name, "oled.storage": storage, "oled.worker": worker_id()}
    with tracked_run(recipe, run_name=f"study {name}", tags=tags) as parent:
        parent.log_params(recipe.flatten())
        run_trials(study, recipe, parent, trials, console)
        result = TuneResult(name, study.best_value, study.best_params, _best(recipe, study))
        parent.log_metrics({"best_value": result.value})
        files = write_study_report(recipe, study, result, console)
        parent.log_artifacts(files)
        parent.log_recipe(recipe)
    console.print(f"report: {result.report_dir}", soft_wrap=True, highlight=False)
    if out is not None:
        save_best(result, out, files[0], storage)
    return result


def _best(recipe: Recipe, study: Any) -> Recipe:
    best = recipe.with_values(study.best_params)
    return best.model_copy(update={"tune": None})
