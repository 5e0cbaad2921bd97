"""A ``python -m inference.serve`` process for tests, and a plain websocket player."""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import numpy as np
from PIL import Image
from websockets.sync.client import connect

from inference.web.protocol import read_frame
from scripts.common import ServerProcess

from .conftest import REPO


class Server(ServerProcess):
    """``with Server("--max-sessions", 2) as s: s.url``: a server on a free loopback port (eager,
    so its frames are the headless runs'), stopped with Ctrl-C at the end; ``s.output`` holds what it printed."""

    def __init__(self, *args, env: dict | None = None, start_s: float = 180, launch=()):
        """``launch``: python's arguments that start the module instead (torchrun and its flags)."""
        server_env = {k: v for k, v in os.environ.items() if not k.startswith("OWL_") or k == "OWL_THREADS"}
        super().__init__([str(a) for a in args], {**server_env, "OWL_COMPILE": "0", **(env or {})},
                         launch=[sys.executable, *launch] if launch else None, cwd=REPO)
        self.start_s = start_s

    def __enter__(self) -> "Server":
        try:
            self.wait_ready(self.start_s)
        except SystemExit as exc:
            self.stop()
            raise AssertionError(str(exc)) from None
        self.ws_url = self.url.replace("http://", "ws://") + "/ws"
        return self

    def stop(self) -> int:
        """Ctrl-C, as a terminal sends it."""
        return super().stop(signal.SIGINT)

    def __exit__(self, *exc):
        self.stop()


class Player:
    """A page's side of the protocol over a plain websocket."""

    def __init__(self, url: str, first: str | None = None, origin: str | None = None, **hello):
        """``first``: send this instead of a hello (and wait for nothing); ``origin``: the page's
        Origin header, as a browser sends it."""
        self.ws = connect(url, open_timeout=30, legacy=True, origin=origin)
        self.messages: list[dict] = []
        self.frames: list[tuple[int, int | None, int, np.ndarray]] = []
        self.seq = 0
        self.ws.send(first if first is not None else json.dumps({"type": "hello", "version": 1, **hello}))
        if first is None:
            self.welcome = self.until(lambda m: m.get("type") in ("welcome", "full", "error"))

    def send(self, obj) -> None:
        self.ws.send(obj if isinstance(obj, (str, bytes)) else json.dumps(obj))

    def controls(self, mouse=(0.0, 0.0), buttons=(0,) * 11) -> int:
        self.seq += 1
        self.send({"type": "controls", "mouse": list(mouse), "buttons": list(buttons), "seq": self.seq})
        return self.seq

    def receive(self, timeout: float = 30):
        """The next message: a dict, or a frame (index, seq, epoch, uint8 image) kept in ``frames``."""
        m = self.ws.recv(timeout=timeout)
        if isinstance(m, bytes):
            index, seq, epoch, image = read_frame(m)
            frame = (index, seq, epoch, np.asarray(Image.open(io.BytesIO(image)).convert("RGB")))
            self.frames.append(frame)
            return frame
        m = json.loads(m)
        self.messages.append(m)
        return m

    def until(self, match, timeout: float = 60):
        """Messages until one ``match``es (a dict) and returns it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.receive(max(0.1, deadline - time.monotonic()))
            if isinstance(m, dict) and match(m):
                return m

    def next_frame(self, timeout: float = 30):
        while True:
            m = self.receive(timeout)
            if isinstance(m, tuple):
                return m

    def close(self):
        self.ws.close()
