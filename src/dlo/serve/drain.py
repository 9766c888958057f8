"""`dlo serve`'s uvicorn server, which drains on SIGTERM.

SIGTERM (what an orchestrator sends before it stops a server): the pool stops admitting, so
new jobs get 503 while the jobs already held (running, queued, video jobs too) run to their
end; then the server stops as on Ctrl-C, and `dlo serve` exits 0. A second SIGTERM, or Ctrl-C,
stops at once, uvicorn's way: stop accepting, wait for the HTTP requests in flight only.
"""

from __future__ import annotations

import signal
import threading
import time

import uvicorn

from dlo.serve.pool import ReplicaPool

DRAINING = "the server is draining (it got SIGTERM): it finishes the jobs it holds and takes no new ones"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, pool: ReplicaPool) -> None:
        super().__init__(config)
        self._pool = pool
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        # SIGTERM is not handed to uvicorn: it would raise it again once stopped, killing this
        # process before it stops the replicas.
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif self._draining:  # the second: stop now
            self.should_exit = True
        else:
            self._draining = True
            threading.Thread(target=self._exit_when_idle, name="dlo-serve-drain", daemon=True).start()

    def _exit_when_idle(self) -> None:
        # Not in the signal handler: it runs on the main thread, which may hold the pool's lock.
        # A request whose headers came before the signal is refused by the pool's submit, so
        # no job is admitted after `pending` was last read here.
        self._pool.stop_admitting(DRAINING)
        while self._pool.pending:
            time.sleep(0.1)
        self.should_exit = True  # read by uvicorn's main loop
