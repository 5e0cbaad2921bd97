"""The web app: the page at ``/``, its websocket at ``/ws``, ``/healthz`` and recordings.

Each websocket is one player: its first message must be a ``hello``; then its controls and
events go to the scheduler and its frames come back. What a page sends is checked message by
message (protocol.py); a bad message gets an error naming the fault, and a page that keeps
sending them, floods, or says nothing for ``idle_timeout`` seconds is closed with the reason.
Frames wait in a one-frame slot: a page too slow to take them gets the newest, never a queue.
"""
from __future__ import annotations

import asyncio
import collections
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..bindings import browser_bindings
from . import protocol
from .protocol import Controls, Event, Hello, ProtocolError
from .scheduler import COSTLY_EVENT_INTERVAL_S, RECORDING_NAME, Player, Scheduler, ServerFull, Stopping

STATIC = Path(__file__).parent / "static"


@dataclass
class Limits:
    idle_timeout: float = 300.0  # seconds without a message before a session is closed
    hello_timeout: float = 10.0
    rate: float = 120.0  # messages a second a page may send on average (the page sends at most ~70)
    burst: int = 240
    max_errors: int = 20  # malformed messages before the connection is closed
    max_outbox: int = 64  # JSON messages waiting for a slow page before it is closed
    allow_origins: tuple[str, ...] = ()  # host names whose pages may play besides the server's own (--allow-origin)
    loopback_only: bool = False  # bound to a loopback address: a page must have asked for a loopback name


class Closing(Exception):
    def __init__(self, code: int, reason: str):
        reason = reason.encode()[:123].decode(errors="ignore")  # a close frame holds 123 bytes of reason
        super().__init__(reason)
        self.code, self.reason = code, reason


class Connection:
    def __init__(self, ws: WebSocket, scheduler: Scheduler, limits: Limits, page: dict):
        self.ws, self.scheduler, self.limits, self.page = ws, scheduler, limits, page
        self.loop = asyncio.get_running_loop()
        self.frame: bytes | None = None  # the newest frame not yet sent
        self.messages: collections.deque = collections.deque()
        self.wake = asyncio.Event()
        self.closing: Closing | None = None
        self.player: Player | None = None
        self.welcomed = False  # frames go out only after the welcome
        self.tokens, self.refilled, self.errors = float(limits.burst), time.monotonic(), 0

    # -- from the scheduler's thread -----------------------------------------------------------
    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._offer, item)
        except RuntimeError:  # the loop has stopped: the server is going down
            pass

    def _offer(self, item) -> None:
        if isinstance(item, bytes):
            if self.frame is not None and self.player is not None:
                self.player.dropped += 1
            self.frame = item
        else:
            if item.pop("close", False):
                self.closing = self.closing or Closing(protocol.CLOSE_SERVER_ERROR, item.get("message", ""))
            self.messages.append(item)
            if len(self.messages) > self.limits.max_outbox:
                self.closing = self.closing or Closing(protocol.CLOSE_PROTOCOL, "the page is not reading its messages")
        self.wake.set()

    # -- this connection's tasks -------------------------------------------------------------------
    async def run(self) -> None:
        await self.ws.accept()
        sender = asyncio.create_task(self._send_loop())
        closing = None
        try:
            await self._converse()
        except Closing as exc:
            closing = exc
        except WebSocketDisconnect:
            pass
        finally:
            # the session is gone before the page hears the close, so /healthz never counts a closed player
            if self.player is not None:
                try:
                    await asyncio.wrap_future(self.scheduler.remove_player(self.player))
                except Stopping:  # the scheduler's thread is ending: it removes every player itself
                    pass
                except asyncio.CancelledError:  # the server's shutdown gave up waiting: it removes every player
                    sender.cancel()
                    return
            self.closing = self.closing or closing
            if self.closing is not None:
                self.wake.set()
                try:
                    await asyncio.wait_for(sender, 2.0)
                except (asyncio.TimeoutError, Exception):
                    sender.cancel()
            else:
                sender.cancel()

    async def _receive(self, timeout: float, waiting_for: str):
        try:
            message = await asyncio.wait_for(self.ws.receive(), timeout)
        except asyncio.TimeoutError:
            raise Closing(protocol.CLOSE_IDLE, f"no message for {timeout:g} s ({waiting_for}); reload to play "
                                               "again") from None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        now = time.monotonic()
        self.tokens = min(self.limits.burst, self.tokens + (now - self.refilled) * self.limits.rate)
        self.refilled = now
        self.tokens -= 1
        if self.tokens < 0:
            raise Closing(protocol.CLOSE_PROTOCOL, f"too many messages: at most {self.limits.rate:g} a second")
        return message["bytes"] if message.get("text") is None else message["text"]

    def _fault(self, exc: ProtocolError) -> None:
        self.errors += 1
        if self.errors > self.limits.max_errors:
            raise Closing(protocol.CLOSE_PROTOCOL, f"more than {self.limits.max_errors} malformed messages; "
                                                   f"the last: {exc}")
        self._tell_error(exc.code, str(exc))

    def _tell_error(self, code: str, message: str) -> None:
        self.messages.append({"type": "error", "code": code, "message": message})
        self.wake.set()

    async def _converse(self) -> None:
        refusal = page_refusal(self.ws.headers.get("origin"), self.ws.headers.get("host", ""), self.limits)
        if refusal is not None:
            raise Closing(protocol.CLOSE_PROTOCOL, refusal)
        try:
            hello = protocol.parse(await self._receive(self.limits.hello_timeout, "a hello first"))
        except ProtocolError as exc:
            raise Closing(protocol.CLOSE_PROTOCOL, str(exc)) from None
        if not isinstance(hello, Hello):
            raise Closing(protocol.CLOSE_PROTOCOL, "the first message must be a hello: "
                                                   '{"type": "hello", "version": 1}')
        try:
            self.player = await asyncio.wrap_future(self.scheduler.add_player(hello, self.post))
        except ServerFull as exc:
            self.messages.append({"type": "full", "message": f"server full, {exc.players} playing",
                                  "players": exc.players, "capacity": exc.capacity})
            raise Closing(protocol.CLOSE_FULL, f"server full, {exc.players} playing") from None
        except (ValueError, OSError, RuntimeError) as exc:
            self.messages.append({"type": "error", "code": "start_failed", "message": str(exc)})
            raise Closing(protocol.CLOSE_SERVER_ERROR, f"the session could not start: {exc}") from None
        self.messages.appendleft({**self.scheduler.welcome(self.player), **self.page, "version": protocol.VERSION})
        self.welcomed = True
        self.wake.set()
        while self.closing is None:
            try:
                message = protocol.parse(await self._receive(self.limits.idle_timeout, "idle"))
            except ProtocolError as exc:
                self._fault(exc)
                continue
            if isinstance(message, Controls):
                self.player.set_controls(message)
            elif isinstance(message, Event):
                added = self.player.add_event(message)
                if added == "flood":
                    raise Closing(protocol.CLOSE_PROTOCOL, "too many events waiting for the next frame")
                if added == "busy":  # (not a fault: a page may click faster than the pacing)
                    self._tell_error("busy", f"{message.name}: the last ones still wait their turn (one each "
                                             f"{COSTLY_EVENT_INTERVAL_S:g} s); try again in a moment")
                self.scheduler.wake.set()
            else:
                self._fault(ProtocolError("hello_again", "hello was already said; send controls or event messages"))

    async def _send_loop(self) -> None:
        try:
            await self._send_all()
        except (WebSocketDisconnect, RuntimeError, OSError):  # the page went away mid-send
            pass

    async def _send_all(self) -> None:
        status_due = time.monotonic() + 1.0
        while True:
            # a page that has not joined hears no status: it waits for a message or its close, and costs nothing
            wait = None if self.player is None else max(0.0, status_due - time.monotonic())
            try:
                await asyncio.wait_for(self.wake.wait(), wait)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            while self.messages:
                await self.ws.send_json(self.messages.popleft())
            if self.closing is not None:
                await self.ws.close(self.closing.code, self.closing.reason)
                return
            if self.frame is not None and self.welcomed:
                frame, self.frame = self.frame, None
                await self.ws.send_bytes(frame)
            if time.monotonic() >= status_due and self.player is not None:
                status_due = time.monotonic() + 1.0
                stats = self.scheduler.health()
                await self.ws.send_json({"type": "status", "players": stats["sessions"], "capacity": stats["capacity"],
                                         "frame": self.player.frames, "dropped": self.player.dropped,
                                         "paused": self.player.paused, "step_ms": stats["last_step_ms"],
                                         "compile": stats["compile"]})


PING_RATE, PING_BURST = 10.0, 20  # pings a second a page may send (a browser sends almost none)


def page_socket_protocol():
    """The websocket protocol uvicorn runs for each page: its sans-I/O one, with pings counted, so
    a flood of pings (which never reach the app) is closed like a flood of messages. Where that
    protocol is not found (another uvicorn), uvicorn's own, by name."""
    try:
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    except ImportError:
        return "websockets-sansio"

    class PageSocket(WebSocketsSansIOProtocol):
        ping_tokens, ping_at = float(PING_BURST), None

        def handle_ping(self) -> None:
            now = time.monotonic()
            if self.ping_at is not None:
                self.ping_tokens = min(PING_BURST, self.ping_tokens + (now - self.ping_at) * PING_RATE)
            self.ping_at, self.ping_tokens = now, self.ping_tokens - 1
            if self.ping_tokens >= 0:
                return super().handle_ping()
            if self.conn.close_sent is None:
                self.close_for_pings(f"too many pings: at most {PING_RATE:g} a second")

        def close_for_pings(self, reason: str) -> None:
            """Close as the app's own close does: the close frame, then the socket once the page
            answers it (or after ``close_timeout``). Closing the socket at once, with the flood's
            pings still arriving, resets the connection, and the page may never read why."""
            self.conn.send_close(protocol.CLOSE_PROTOCOL, reason)
            self.queue.put_nowait({"type": "websocket.disconnect", "code": protocol.CLOSE_PROTOCOL, "reason": reason})
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
            if self.read_paused:  # the page's answer must be read
                self.read_paused = False
                self.transport.resume_reading()
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)

    return PageSocket


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(text: str) -> str | None:
    """The host name of a URL or an origin (``https://Name:443``) or of a bare ``host[:port]``."""
    try:
        return urllib.parse.urlsplit(text if "://" in text else "//" + text).hostname
    except ValueError:
        return None


def page_refusal(origin: str | None, host: str, limits: Limits) -> str | None:
    """Why a websocket may not play here (None: it may). A browser's page (its ``Origin``) must
    be this server's own (the host name it asked for, ``Host``; ports are not compared, as a proxy
    may forward the host without its port) or one of ``--allow-origin``, so another site open in
    the player's browser cannot open a session. A server on a loopback address answers only to
    loopback names (or ``--allow-origin``): a site whose name was made to resolve to 127.0.0.1
    (DNS rebinding) asks for its own name. Clients that send no ``Origin`` (scripts) may play."""
    asked = host_name(host)
    if limits.loopback_only and asked not in (*LOOPBACK_NAMES, *limits.allow_origins):
        return (f"this server answers to localhost only, not {asked!r}: open http://127.0.0.1:<port>/ "
                f"(or start it with --allow-origin {asked})")
    if origin is None:
        return None
    page = host_name(origin) if "://" in origin else None  # ("null": a page from a file)
    if page is None or (page != asked and page not in limits.allow_origins):
        return f"a page from {origin} may not play here: open the server's own page (or --allow-origin)"
    return None


def create_app(scheduler: Scheduler, limits: Limits | None = None) -> Starlette:
    """The app over a started scheduler (its sessions built)."""
    limits = limits or Limits()
    controls = scheduler.sessions.world.controls
    page = {"bindings": browser_bindings(controls.get("bindings")),
            "sensitivity": float(controls.get("sensitivity", 1.0)), "events": list(protocol.EVENTS)}

    async def index(request):
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def healthz(request):
        if not scheduler.is_alive():
            return JSONResponse({"status": "error", "message": f"the model thread stopped: {scheduler.error}"}, 503)
        return JSONResponse({"status": "ok", "version": protocol.VERSION, **scheduler.health()})

    async def favicon(request):
        return Response(status_code=204)

    async def recording(request):
        name = request.path_params["name"]
        path = scheduler.opt.record_dir / name
        if not RECORDING_NAME.match(name) or not path.is_file():
            return PlainTextResponse(f"no recording {name!r} here (recordings last while the server runs)", 404)
        return FileResponse(path, media_type="video/mp4", filename=time.strftime("owl-%Y%m%d-%H%M%S.mp4"))

    async def websocket(ws: WebSocket):
        await Connection(ws, scheduler, limits, page).run()

    return Starlette(routes=[Route("/", index), Route("/healthz", healthz), Route("/favicon.ico", favicon),
                             Route("/recordings/{name}", recording),
                             WebSocketRoute("/ws", websocket), Mount("/static", StaticFiles(directory=STATIC))])
