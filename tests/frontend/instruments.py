"""Trio instruments the frontend tests watch a request's tasks with."""

from __future__ import annotations

import trio


class Spawns(trio.abc.Instrument):
    """The names of the tasks spawned while it is installed, in order."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)
