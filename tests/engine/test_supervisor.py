"""The restart rule of ``Supervisor``: restart a child that exits after it was
ready; stop (``on_stop``, once) for one that exits before, or when restarting is off."""

from __future__ import annotations

import time

from pagedllm.engine.supervisor import Supervisor


class FakeChild:
    def __init__(self) -> None:
        self.starts, self.code = 0, None

    def start(self) -> str:
        self.starts += 1
        self.code = None
        return f"start {self.starts}"

    def exit_code(self) -> int | None:
        return self.code


def test_restart_after_ready_stop_before_ready_or_without_restart():
    stops: list[int | None] = []
    child = FakeChild()
    supervisor = Supervisor(child, "child", restart=True, on_stop=stops.append)
    assert supervisor.start() == "start 1"
    assert supervisor.check() and child.starts == 1  # running: nothing to do
    supervisor.ready()
    child.code = -9
    assert supervisor.check() and child.starts == 2 and not stops  # ready, then died: started again
    child.code = 1  # the restarted child dies before it is ready: it cannot start, so stop
    assert not supervisor.check() and stops == [1] and child.starts == 2
    assert not supervisor.check() and stops == [1]  # on_stop once; the child is left alone

    no_restart = Supervisor(FakeChild(), "child", restart=False, on_stop=stops.append)
    no_restart.start()
    no_restart.ready()
    no_restart.child.code = 3
    assert not no_restart.check() and stops == [1, 3] and no_restart.child.starts == 1


def test_uptime_counts_as_ready_for_a_user_that_cannot_see_readiness():
    stops: list[int | None] = []
    child = FakeChild()
    supervisor = Supervisor(child, "child", restart=True, on_stop=stops.append, ready_after_s=0.05)
    supervisor.start()
    time.sleep(0.06)
    child.code = 1
    assert supervisor.check() and child.starts == 2  # ran long enough: restarted
    child.code = 1  # at once: not long enough
    assert not supervisor.check() and stops == [1]
