"""`oled tune`: an Optuna study over `[tune.params]`, one nested MLflow run per trial.

The objective is a registered component (kind `objective`): a callable taking a candidate
recipe and returning a dict of metrics; `[tune] metric` picks the one to optimise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from oled import registry as reg
from oled.experiment.tracking import Tracker, tracked_run
from oled.recipe import Recipe, SearchSpace, load_recipe

Objective = Callable[[Recipe], dict[str, float]]


@dataclass
class TuneResult:
    """The best trial of a study."""

    study_name: str
    value: float
    params: dict[str, Any]
    recipe: Recipe


def simulate_objective(recipe: Recipe) -> dict[str, float]:
    """Replay `[tune] trace` through the recipe's policies in the simulator."""
    from oled.decoding.trace_file import Trace
    from oled.trace.simulate import simulate_recipe

    assert recipe.tune is not None
    if recipe.tune.trace is None:
        raise ValueError("objective 'simulate' needs [tune] trace = PATH (a recorded trace)")
    from oled.recipe import beside

    result, bound = simulate_recipe(Trace.load(beside(recipe.tune.trace, recipe.folder)), recipe)
    out = {k: float(v) for k, v in result.to_dict().items() if isinstance(v, (int, float))}
    return out | {"belady_bound": bound}


def run_objective(recipe: Recipe) -> dict[str, float]:
    """Real generations through `oled.build` (replays of `workload.routing`'s trace when it
    names one): the run's summary figures."""
    from oled.experiment.report import summarize
    from oled.experiment.run import load_workload, run_loaded
    from oled.runtime import build

    work = load_workload(recipe)
    summary = summarize(run_loaded(build(recipe), recipe, work))
    return {k: float(v) for k, v in summary.items() if isinstance(v, (int, float))}


def storage_for(url: str | None) -> Any:
    """An Optuna storage: a URL, `journal:PATH` (a journal file), or sqlite in the cwd."""
    import optuna

    if url is None:
        return f"sqlite:///{(Path.cwd() / 'optuna.db').resolve()}"
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        backend = JournalFileBackend(url.removeprefix("journal:"))
        return optuna.storages.JournalStorage(backend)
    return url


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

        try:
            with tracked_run(
                self.recipe.with_values(trial.params),
                run_name=f"{study.study_name}/{trial.number}",
                parent=self.parent,
                tags={"oled.study": study.study_name, "oled.trial": trial.number},
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


def tune_recipe(
    recipe: Recipe,
    *,
    trials: int | None = None,
    out: Path | None = None,
    console: Console | None = None,
) -> TuneResult:
    """Run (or resume) the study; trials this process runs default to those still missing."""
    import optuna

    tune = recipe.tune
    if tune is None:
        raise ValueError("recipe has no [tune] section")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = tune.study_name or recipe.name
    study = optuna.create_study(
        storage=storage_for(tune.storage),
        study_name=name,
        direction=tune.direction,
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=tune.seed),
    )
    complete = (optuna.trial.TrialState.COMPLETE,)
    todo = trials if trials is not None else tune.trials - len(study.get_trials(states=complete))
    objective = make_objective(recipe, reg.get("objective", tune.objective))
    columns = (TextColumn("tune {task.description}"), BarColumn(), MofNCompleteColumn())
    with (
        tracked_run(recipe, run_name=f"study {name}", tags={"oled.study": name}) as parent,
        Progress(*columns, console=console or Console(stderr=True), transient=True) as bar,
    ):
        parent.log_params(recipe.flatten())
        task = bar.add_task(name, total=max(todo, 0))
        callbacks: list[Any] = [TrialLogger(recipe, parent, lambda: bar.advance(task))]
        if trials is None:
            callbacks.append(optuna.study.MaxTrialsCallback(tune.trials, states=complete))
        if todo > 0:
            study.optimize(objective, n_trials=todo, callbacks=callbacks)
        result = TuneResult(name, study.best_value, study.best_params, _best(recipe, study))
        parent.log_metrics({"best_value": result.value})
    if out is not None:
        out.write_text(best_recipe_text(result))
        load_recipe(out)  # the written recipe must validate
    return result


def _best(recipe: Recipe, study: Any) -> Recipe:
    best = recipe.with_values(study.best_params)
    return best.model_copy(update={"tune": None})
