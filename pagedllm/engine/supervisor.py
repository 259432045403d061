"""The restart rule of every supervised child: the engine-core process (under
the API server, or under ``serve --api-server-count N``) and the replicas of
``serve --data-parallel-size N``.

The rule: a child that exits is started again (when restarting is on) if it
became ready since it was last started; one that exits before that is not,
because it cannot start at all (a model that no longer loads, a port taken):
starting it again would loop, so everything stops, as without restarting.

``Supervisor`` owns that rule and the decision; starting a child, noticing its
exit and stopping the server stay with the user, through ``Child`` and the
``on_stop`` callback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from pagedllm.logger import init_logger

logger = init_logger(__name__)


class Child(Protocol):
    """What a supervisor needs of a child: start it again, and its exit status
    (None while it runs)."""

    def start(self) -> object: ...
    def exit_code(self) -> int | None: ...


class Supervisor:
    """Applies the restart rule to one child.

    ``restart``: whether a child that exits after it was ready is started
    again (``--restart-engine-on-failure``; replicas always are). ``on_stop``
    gets the exit status when the child is not restarted: the user stops
    the server. ``ready_after_s``: for a user that cannot see the child's
    readiness, the child counts as ready once it has run this long.

    Safety rules: ``start`` and ``check`` from one thread (the user's watch);
    ``ready`` from any thread (it only sets a flag). After ``check`` has
    returned False the child is left alone: ``on_stop`` has been called once.
    """

    def __init__(self, child: Child, name: str, restart: bool, on_stop: Callable[[int | None], None],
                 ready_after_s: float | None = None) -> None:
        self.child, self.name, self.restart = child, name, restart
        self.on_stop = on_stop
        self.ready_after_s = ready_after_s
        self.stopped = False
        self._ready = threading.Event()
        self._started_at = time.monotonic()

    def start(self) -> object:
        """Start the child (it is not ready until ``ready()`` says so); what its ``start`` returns."""
        self._ready.clear()
        self._started_at = time.monotonic()
        return self.child.start()

    def ready(self) -> None:
        """The child answered: from now on an exit is a crash, and restartable."""
        self._ready.set()

    def is_ready(self) -> bool:
        """Ready since the latest start (by ``ready()``, or by uptime with ``ready_after_s``)."""
        if self.ready_after_s is not None and time.monotonic() - self._started_at >= self.ready_after_s:
            self._ready.set()
        return self._ready.is_set()

    def check(self) -> bool:
        """Apply the rule if the child has exited; False once it is stopped for good."""
        if self.stopped:
            return False
        code = self.child.exit_code()
        ready = self.is_ready()
        if code is None:
            return True
        if self.restart and ready:
            logger.warning("%s exited (status %s): starting it again", self.name, code)
            self.start()
            return True
        if not ready:
            logger.error("%s exited (status %s) before it was ready%s: the server stops", self.name, code,
                         f" ({self.ready_after_s:.0f} s or less after its start)" if self.ready_after_s else "")
        else:
            logger.error("%s exited (status %s): the server stops", self.name, code)
        self.stopped = True
        self.on_stop(code)
        return False
