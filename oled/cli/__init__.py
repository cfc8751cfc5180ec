"""The `oled` command line: the app, with one module per command group.

Each group's module adds its commands (`register(app)`); each command imports its
implementation lazily, so that `oled --help` stays fast.
"""

from __future__ import annotations

import warnings

import typer

from oled.cli.options import show_warning

app = typer.Typer(
    name="oled",
    help="OLED-MoE: run MoE diffusion language models (LLaDA2) on GPUs too small for all experts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _every_command() -> None:
    warnings.showwarning = show_warning  # the command line's warnings are one line each


def _register_commands() -> None:
    from oled.cli import experiment, model, trace, using

    model.register(app)
    using.register(app)
    experiment.register(app)
    trace.register(app)


_register_commands()


def main() -> None:
    app()
