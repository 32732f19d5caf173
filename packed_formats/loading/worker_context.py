"""The multiprocessing context the loader gives torch's DataLoader: the standard one, with one lock less.

torch tells its workers to stop with one ``Event`` shared by all of them, and each
worker asks ``is_set()`` for every index it receives.  A ``multiprocessing``
Event's ``is_set`` takes the event's lock.  A worker killed while it holds that
lock (the out-of-memory killer does not wait for a good moment) leaves it locked
for good, and the main process, which asks the same event when it notices the
dead worker, then waits forever instead of raising: a job that sits until its
walltime.  Here ``is_set`` reads the event's semaphore without the lock, so no
worker ever holds it; ``set`` (the main process only, once) still takes it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.synchronize
from typing import Any, Dict


class LockFreeEvent(multiprocessing.synchronize.Event):
    """A ``multiprocessing`` Event whose ``is_set`` takes no lock (where the platform can read a
    semaphore's value: Linux; elsewhere it is the standard one)."""

    def is_set(self) -> bool:
        try:
            return self._flag.get_value() > 0  # type: ignore[attr-defined]
        except NotImplementedError:  # macOS has no sem_getvalue
            return super().is_set()


class _LockFreeEvents:
    """Mixed into a standard context: its ``Event()`` is a ``LockFreeEvent``."""

    def Event(self) -> LockFreeEvent:  # noqa: N802 (multiprocessing's name)
        return LockFreeEvent(ctx=self.get_context())  # type: ignore[attr-defined]


_STANDARD = {name: type(multiprocessing.get_context(name)) for name in multiprocessing.get_all_start_methods()}
_MADE: Dict[str, multiprocessing.context.BaseContext] = {}


def worker_context(given: Any) -> Any:
    """The context to hand torch for ``given`` (a start method's name, a standard context, or None for
    the default): that start method's standard context with a lock-free ``Event.is_set``.  Anything
    else (a context of another kind, ours included, or a name that is no start method) is handed on
    as it is: torch says what is wrong with it, if anything."""
    if given is None:  # the default start method, named: get_context(None) would fix it for the process
        given = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    name = given if isinstance(given, str) else next((n for n, kind in _STANDARD.items() if type(given) is kind), None)
    if name not in _STANDARD:
        return given
    if name not in _MADE:
        _MADE[name] = type(f"LockFree{_STANDARD[name].__name__}", (_LockFreeEvents, _STANDARD[name]), {})()
    return _MADE[name]
