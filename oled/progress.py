"""Progress bars on the terminal: transient, on stderr, and nothing at all when stderr is not
a terminal (a pipe or a log file gets no bar and no stray newline)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


def track(
    items: Sequence[T], what: str, *, show: bool = True, console: Console | None = None
) -> Iterator[T]:
    """`items` one at a time, under a bar of `what` while `show` and the console (stderr by
    default) is a terminal."""
    console = console or Console(stderr=True)
    if not (show and console.is_terminal):
        yield from items
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(what, total=len(items))
        for item in items:
            yield item
            bar.advance(task)
