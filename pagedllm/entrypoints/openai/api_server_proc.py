"""One more API server process of ``pagedllm serve --api-server-count N`` (N > 1).

When one front end (HTTP, tokenization, detokenization, SSE) is the limit, N processes serve
the same listening socket (the kernel hands each new connection to one of them) in front of
ONE engine core process, each with a channel of its own to the core (vLLM's
``--api-server-count``). The ``pagedllm serve`` process is front end 0 and the supervisor: it
binds the socket, starts the core with N channels, then starts this module N - 1 times as
``python -m pagedllm.entrypoints.openai.api_server_proc INIT_FD LISTEN_FD CORE_FD`` and sends
each, over INIT_FD, (serve's arguments, the engine config, the core's info, its index).

Lifetime: this process exits when the supervisor does (end of INIT_FD; SIGTERM from Linux if
it is killed) or when the core dies; the supervisor passes SIGTERM/SIGINT on, so every process
drains its own requests (``shutdown.py``); the supervisor exits (status 1) when one of these
processes dies. ``/metrics`` of each process counts the requests it served; the gauges
(running, waiting, KV usage) are the core's, the same in all.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

from pagedllm.utils.channel import Channel
from pagedllm.utils.child import child_channel

logger = logging.getLogger(__name__)


def serve(init: Channel, listen_fd: int, core_fd: int) -> int:
    """Build this front end from the supervisor's message and serve until told to stop."""
    import uvicorn

    from pagedllm.engine.mp_async_llm import MPAsyncLLM
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.entrypoints.openai.shutdown import (
        DrainingServer,
        exit_cleanly,
        shutdown_timeout_of,
    )

    args, config, info, index = init.recv()
    signal.signal(signal.SIGTERM, exit_cleanly)  # uvicorn raises it again once it has stopped
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "INFO")).upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s api-server-{index} %(name)s: %(message)s",
    )
    listen = socket.socket(fileno=listen_fd)
    core = Channel(socket.socket(fileno=core_fd))
    llm = MPAsyncLLM(config, attach=(core, info, index))
    died: list[str] = []
    try:
        app = build_app(llm, args)
        config_ = uvicorn.Config(
            app, log_level=getattr(args, "uvicorn_log_level", "info"), timeout_keep_alive=5
        )
        server = DrainingServer(config_, app.state.drain, shutdown_timeout_of(args))

        def on_dead(message: str) -> None:
            died.append(message)
            server.should_exit = True

        def watch_supervisor() -> None:
            try:
                init.recv()  # nothing more is sent: this returns at the end of the channel
            except (EOFError, OSError):
                pass
            server.should_exit = True

        llm.on_dead.append(on_dead)
        threading.Thread(target=watch_supervisor, name="pagedllm-supervisor", daemon=True).start()
        init.send(("ready", os.getpid()))
        server.run(sockets=[listen])
    finally:
        llm.shutdown()
    return 1 if died else 0


def main(argv: list[str]) -> None:
    """Entry point (see the module docstring)."""
    init = child_channel(argv)
    listen_fd, core_fd = int(argv[2]), int(argv[3])
    for fd in (listen_fd, core_fd):
        os.set_inheritable(fd, False)
    sys.exit(serve(init, listen_fd, core_fd))


if __name__ == "__main__":
    main(sys.argv)
