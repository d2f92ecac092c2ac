"""Callbacks that front ends add and remove from their own threads while another thread runs them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator


class Hooks:
    """A set of callbacks, in the order added. Each change makes a new tuple under a lock, so a thread running over
    them (the engine's loop) sees a fixed set and never waits for the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: tuple[Callable, ...] = ()

    def add(self, hook: Callable) -> Callable[[], None]:
        """-> a call that removes this hook (only this one: the same callable added twice is two hooks)."""
        with self._lock:
            self.current = (*self.current, hook)

        def remove() -> None:
            with self._lock:
                self.current = tuple(h for h in self.current if h is not hook)

        return remove

    def __iter__(self) -> Iterator[Callable]:
        return iter(self.current)
