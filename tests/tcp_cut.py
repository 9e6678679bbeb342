"""A TCP forwarder a test can cut: one process's connection to a real server
(nats-server) broken while everything else stays connected, as a network
partition does to one host."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class CutProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<target>``. :meth:`cut` closes
    every connection through it and refuses new ones (accepted, then closed: the
    port stays this proxy's) until :meth:`restore`. :meth:`stall` holds what the
    server sends (the client's bytes still go through: a publish is stored, its
    acknowledgement waits) until :meth:`flow`."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.open = True
        self.accepted = 0  # connections forwarded, ever
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._down = asyncio.Event()  # set: the server's bytes flow to the client
        self._down.set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def __aenter__(self) -> CutProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        await self._server.wait_closed()

    def cut(self) -> None:
        """Break every connection now, both ways, and refuse new ones."""
        self.open = False
        for writer in list(self._pipes):
            writer.transport.abort()  # nothing buffered is delivered
        self._pipes.clear()

    def restore(self) -> None:
        self.open = True

    def stall(self) -> None:
        self._down.clear()

    def flow(self) -> None:
        self._down.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        if not self.open:  # cut while it connected
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self.accepted += 1
        self._pipes |= {writer, up_writer}
        for src, dst, gate in ((reader, up_writer, None), (up_reader, writer, self._down)):
            task = asyncio.create_task(self._pump(src, dst, gate))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event | None
    ) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await src.read(65536):
                if gate is not None:
                    await gate.wait()
                dst.write(data)
                await dst.drain()
        dst.transport.abort()  # one side gone: the other goes too
        self._pipes.discard(dst)
