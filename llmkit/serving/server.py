"""Running the application on uvicorn: in the foreground (``llmkit serve``: SIGTERM and
Ctrl-C drain the requests in flight, then the engine stops) or in a background thread
(:class:`ServerThread`: tests, ``llmkit bench serve``)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from llmkit.errors import LlmkitError
from llmkit.serving.engine import Engine


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one); a taken port or an
    unknown address is a one-line error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LlmkitError(f"--host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise LlmkitError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _config(
    engine: Engine, model_name: str, max_concurrent: int, log_level: str = "info", **app: Any
) -> Any:
    import uvicorn

    from llmkit.serving.app import create_app

    application = create_app(engine, model_name=model_name, max_concurrent=max_concurrent, **app)
    return uvicorn.Config(
        application,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=None,  # drain: every request in flight completes
        lifespan="on",
    )


def serve_forever(
    engine: Engine, sock: socket.socket, *, model_name: str, max_concurrent: int = 64
) -> None:
    """Serve on ``sock`` until SIGTERM or SIGINT; then stop accepting, let the requests in
    flight finish, stop the engine."""
    import signal

    import uvicorn

    server = uvicorn.Server(_config(engine, model_name, max_concurrent))
    # uvicorn drains on SIGTERM, then raises the signal again under the handler that was
    # there before it: a no-op here, so a drained server exits 0 (Ctrl-C still ends as a
    # KeyboardInterrupt, 130)
    before = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, before)


class ServerThread:
    """The server on ``127.0.0.1`` at a free port, in a daemon thread: ``url`` once
    :meth:`start` returns; :meth:`stop` drains and joins."""

    def __init__(
        self, engine: Engine, *, model_name: str = "model", max_concurrent: int = 64, **app: Any
    ) -> None:
        import uvicorn

        self.engine = engine
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = _config(engine, model_name, max_concurrent, log_level="warning", **app)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
