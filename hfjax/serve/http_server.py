"""`ServerThread`: an ASGI app (`hfjax.serve.app.create_app`) served by uvicorn on a background thread, for tests,
benchmarks and notebooks; `hfjax serve` runs uvicorn in the foreground instead."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


class ServerThread:
    """Serves `app` on `host` at `port` (0: a free port) from a daemon thread: `start` returns the base URL once the
    server accepts connections, `stop` shuts it down (pending long polls are cut after `grace_s`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, grace_s: float = 1.0) -> None:
        self.app, self.host, self.port, self.grace_s = app, host, port, grace_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=self.grace_s, lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"uvicorn:{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._server = self._thread = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
