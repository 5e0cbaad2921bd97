"""The websocket protocol between the page and the server (docs/serve.md), version 1.

The client sends JSON text: first ``hello``, then ``controls`` and ``event`` messages. The
server sends each frame as a binary message, a 16-byte header (``FRAME_HEADER``) and the
image, and JSON text for everything else. Every client message is checked here, field by
field; a bad one raises ``ProtocolError`` naming the field, the value and what it must be.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from owl_wms.controls import BUTTONS, N_BUTTONS

VERSION = 1
MAX_MESSAGE_BYTES = 4096  # a controls message is about 100 bytes
MOUSE_LIMIT = 10_000.0  # |dx|, |dy| of one message, in the page's scaled pixels
MAX_SEQ = 2**32 - 1  # a frame header carries the seq in 32 bits
MAX_SEED = 2**63 - 1
MAX_LEVEL = 2**31 - 1
EVENTS = ("restart", "level", "pause", "resume", "record_start", "record_stop")
FORMATS = ("jpeg", "png")  # png: lossless, for exact comparisons
# magic, frame index (since the session began), last controls seq the frame used (NO_SEQ: none yet), cache epoch
FRAME_HEADER = struct.Struct("<4sIII")
FRAME_MAGIC = b"OWLF"
NO_SEQ = MAX_SEQ

# close codes (the page shows the reason)
CLOSE_PROTOCOL = 1008  # policy violation: a malformed conversation, a flood
CLOSE_FULL = 1013  # try again later
CLOSE_IDLE = 4000
CLOSE_SERVER_ERROR = 1011


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Hello:
    version: int
    seed: int | None = None
    level: int | None = None
    format: str = "jpeg"


@dataclass(frozen=True)
class Controls:
    mouse: tuple[float, float]
    buttons: tuple[int, ...]
    seq: int


@dataclass(frozen=True)
class Event:
    name: str
    level: int | None = None


def _show(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(obj: dict, field: str, lo: int, hi: int) -> int:
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError("bad_field", f"{obj['type']}.{field} is {_show(value)}; it must be a whole number "
                                         f"in [{lo}, {hi}]")
    return value


def _fields(obj: dict, required: set, optional: set = frozenset()) -> None:
    missing, unknown = required - set(obj), set(obj) - required - optional - {"type"}
    if missing:
        raise ProtocolError("missing_field", f"{obj['type']} lacks {sorted(missing)}")
    if unknown:
        raise ProtocolError("unknown_field", f"{obj['type']} has unknown fields {sorted(unknown)}; it takes "
                                             f"{sorted(required | set(optional))}")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ProtocolError("bad_json", f"an object repeats a key ({sorted(k for k in set(keys) if keys.count(k) > 1)})")
    return dict(pairs)


def _no_constant(name):
    raise ProtocolError("bad_json", f"{name} is not a number JSON allows")


def parse(message: str | bytes) -> Hello | Controls | Event:
    """A client's message, checked; ``ProtocolError`` otherwise."""
    if isinstance(message, (bytes, bytearray)):
        raise ProtocolError("binary", "the server takes JSON text messages, not binary ones")
    if len(message) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_big", f"a message of {len(message)} characters; at most {MAX_MESSAGE_BYTES}")
    try:
        obj = json.loads(message, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError("bad_json", f"not JSON: {str(exc)[:80]}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("bad_type", f"a message must be a JSON object with a string \"type\"; got {_show(obj)}")
    kind = obj["type"]
    if kind == "hello":
        _fields(obj, {"version"}, {"seed", "level", "format"})
        if type(obj["version"]) is not int or obj["version"] != VERSION:  # (1.0 and true are not 1 here)
            raise ProtocolError("version", f"protocol version {_show(obj['version'])} is not served here; this "
                                           f"server speaks version {VERSION}")
        fmt = obj.get("format", "jpeg")
        if fmt not in FORMATS:
            raise ProtocolError("bad_field", f"hello.format is {_show(fmt)}; it must be one of {list(FORMATS)}")
        return Hello(VERSION, _int(obj, "seed", 0, MAX_SEED) if "seed" in obj else None,
                     _int(obj, "level", 0, MAX_LEVEL) if "level" in obj else None, fmt)
    if kind == "controls":
        _fields(obj, {"mouse", "buttons", "seq"})
        mouse, buttons = obj["mouse"], obj["buttons"]
        if not (isinstance(mouse, list) and len(mouse) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                and abs(v) <= MOUSE_LIMIT for v in mouse)):  # (NaN compares false; a huge int is never made a float)
            raise ProtocolError("bad_field", f"controls.mouse is {_show(mouse)}; it must be [dx, dy], two numbers "
                                             f"of at most {MOUSE_LIMIT:g} in size")
        if not (isinstance(buttons, list) and len(buttons) == N_BUTTONS and all(
                type(b) is int and b in (0, 1) for b in buttons)):
            raise ProtocolError("bad_field", f"controls.buttons is {_show(buttons)}; it must be {N_BUTTONS} ints 0 "
                                             f"or 1 in the order {' '.join(BUTTONS)}")
        return Controls((float(mouse[0]), float(mouse[1])), tuple(buttons), _int(obj, "seq", 0, MAX_SEQ - 1))
    if kind == "event":
        name = obj.get("name")
        if name not in EVENTS:
            raise ProtocolError("bad_field", f"event.name is {_show(name)}; it must be one of {list(EVENTS)}")
        _fields(obj, {"name"}, {"level"} if name == "level" else set())
        return Event(name, _int(obj, "level", 0, MAX_LEVEL) if "level" in obj else None)
    raise ProtocolError("bad_type", f"unknown message type {_show(kind)}; the types are hello, controls, event")


def frame_message(image: bytes, index: int, seq: int | None, epoch: int) -> bytes:
    """A frame as the server sends it: the header, then the encoded image."""
    return FRAME_HEADER.pack(FRAME_MAGIC, index & 0xFFFFFFFF, NO_SEQ if seq is None else seq, epoch & 0xFFFFFFFF) + image


def read_frame(message: bytes) -> tuple[int, int | None, int, bytes]:
    """(frame index, seq or None, epoch, image) of a frame message (clients, tests)."""
    magic, index, seq, epoch = FRAME_HEADER.unpack_from(message)
    if magic != FRAME_MAGIC:
        raise ValueError(f"not a frame message (magic {magic!r})")
    return index, None if seq == NO_SEQ else seq, epoch, message[FRAME_HEADER.size:]
