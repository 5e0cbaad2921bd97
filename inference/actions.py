"""Action scripts for rollouts: built-in names and a JSON-lines file format.

File format: one JSON object per line. A frame: ``{"mouse": [dx, dy], "buttons": [11 ints]}``,
buttons in the order W A S D LSHIFT SPACE R F E LMB RMB. A play session may also record
pipeline events between frames, replayed in order: ``{"event": "restart"}``,
``{"event": "clip", "clip": 1}``, ``{"event": "world_seed", "seed": 7}``,
``{"event": "ground_truth", "on": true}``, ``{"event": "bias", "value": -1.5}`` (soft forgetting),
``{"event": "snapshot"}`` / ``{"event": "restore"}`` (branch: return to the snapshot's state). Blank lines are skipped.
"""
from __future__ import annotations

import difflib
import json
import weakref
from pathlib import Path

import numpy as np

from owl_wms.config import is_number, is_whole
from owl_wms.controls import BUTTONS
from owl_wms.maze.worlds import load_level

Action = tuple[list[float], list[int]]
BUILTIN = ("idle", "forward", "turn", "walk_turn", "random")
EVENTS = {"restart": (), "clip": ("clip",), "world_seed": ("seed",), "ground_truth": ("on",), "bias": ("value",),
          "snapshot": (), "restore": ()}

MOUSE_MAX = 1e6  # a frame's |dx|, |dy| in an action file: far past any turn, and finite as the model's float32
MAX_FRAMES = 100_000  # a run's frames: about 2 hours at 15 FPS; the action list is built up front


def _press(*names: str) -> list[int]:
    return [int(b in names) for b in BUTTONS]


def _builtin(name: str, n: int, seed: int) -> list[Action]:
    if name == "idle":
        return [([0.0, 0.0], _press()) for _ in range(n)]
    if name == "forward":
        return [([0.0, 0.0], _press("W")) for _ in range(n)]
    if name == "turn":
        return [([4.0, 0.0], _press()) for _ in range(n)]
    if name == "walk_turn":  # walk, then turn right while walking, in 32-frame phases
        return [([0.0, 0.0] if (i // 32) % 2 == 0 else [4.0, 0.0], _press("W")) for i in range(n)]
    # random: held keys with persistence and a smooth mouse, reproducible from the seed
    rng = np.random.default_rng(seed)
    held = np.zeros(len(BUTTONS), dtype=bool)
    mouse = np.zeros(2)
    out = []
    for _ in range(n):
        flip = rng.random(len(BUTTONS)) < np.where(held, 0.15, 0.04)
        held = held ^ flip
        mouse = 0.8 * mouse + 0.2 * rng.normal(0, 6, size=2)
        out.append(([round(float(mouse[0]), 4), round(float(mouse[1]), 4)], held.astype(int).tolist()))
    return out


def shorten(obj, limit: int = 120) -> str:
    """``repr(obj)`` cut to ``limit`` characters for error messages."""
    text = repr(obj)
    return text if len(text) <= limit else text[:limit - 15] + f"... ({len(text)} chars)"


# event field -> (check, what it must be)
FIELDS = {"clip": (lambda v: is_whole(v) and v >= 0, "a clip index, a whole number >= 0"),
          "seed": (lambda v: is_whole(v) and 0 <= v < 2**31, "a simulator level, a whole number in [0, 2^31)"),
          "on": (lambda v: isinstance(v, bool), "true or false"),
          "value": (lambda v: is_number(v) and -100 <= v <= 100, "a number in [-100, 100]")}


def parse_action(obj, where: str):
    """A frame as (mouse, buttons), or an event as a dict with its ``event`` name; anything else
    is refused with ``where`` (file:line) and what was expected."""
    if isinstance(obj, dict) and "event" in obj:
        name = obj["event"]
        if not isinstance(name, str) or name not in EVENTS or set(obj) - {"event", *EVENTS[name]} or set(EVENTS[name]) - set(obj):
            raise ValueError(f"{where}: unknown or malformed event {shorten(obj)}; events: "
                             + ", ".join(f"{k}({', '.join(v)})" for k, v in EVENTS.items()))
        for field in EVENTS[name]:
            ok, what = FIELDS[field]
            if not ok(obj[field]):
                raise ValueError(f"{where}: event {name!r} has {field}={shorten(obj[field])}; it must be {what}")
        return dict(obj)
    if not isinstance(obj, dict) or "mouse" not in obj or "buttons" not in obj:
        raise ValueError(f"{where}: expected {{\"mouse\": [dx, dy], \"buttons\": [11 ints]}}, got {shorten(obj)}")
    mouse, buttons = obj["mouse"], obj["buttons"]
    if not isinstance(mouse, list) or len(mouse) != 2 or not all(is_number(v) and abs(v) <= MOUSE_MAX for v in mouse):
        raise ValueError(f"{where}: mouse must be 2 finite numbers of at most {MOUSE_MAX:g} in size, got {shorten(mouse)}")
    if (not isinstance(buttons, list) or len(buttons) != len(BUTTONS)
            or not all(is_whole(v) and v in (0, 1) for v in buttons)):
        raise ValueError(f"{where}: buttons must be {len(BUTTONS)} values of 0/1 "
                         f"({' '.join(BUTTONS)}), got {shorten(buttons)}")
    return [float(v) for v in mouse], [int(v) for v in buttons]


def is_event(item) -> bool:
    return isinstance(item, dict)


def read_action_file(path: str | Path, clips: int | None = None) -> list:
    """The frames and events of a JSON-lines file, each line checked, and the events' order:
    a restore needs a snapshot before it, and a clip index must be one of the world's ``clips``
    (when known)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"action file {str(path)!r} " + ("is a folder" if path.is_dir() else "does not exist")
                         + "; give a JSON-lines file (--save-actions writes one)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"action file {str(path)!r} is not a text file of JSON lines") from None
    items, snapshot = [], False
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}:{i}: JSON nested too deeply for an action") from None
        item = parse_action(obj, f"{path}:{i}")
        if is_event(item):
            snapshot |= item["event"] == "snapshot"
            if item["event"] == "restore" and not snapshot:
                raise ValueError(f"{path}:{i}: a restore event before any snapshot event; add "
                                 '{"event": "snapshot"} before it')
            if item["event"] == "clip" and clips is not None and item["clip"] >= clips:
                raise ValueError(f"{path}:{i}: clip {item['clip']} does not exist: this world has {clips} clips"
                                 + (f" (0 to {clips - 1})" if clips else ""))
        items.append(item)
    if not any(not is_event(x) for x in items):
        raise ValueError(f"action file {str(path)!r} holds no frames")
    return items


def action_line(item) -> str:
    if is_event(item):
        return json.dumps(item) + "\n"
    mouse, buttons = item
    return json.dumps({"mouse": [float(v) for v in mouse], "buttons": [int(v) for v in buttons]}) + "\n"


def write_action_file(path: str | Path, items: list):
    Path(path).write_text("".join(action_line(x) for x in items))


# each session's last snapshot event (the app's, not the pipeline's: a session forgets it with itself)
BOOKMARKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def apply_event(pipe, event: dict):
    """Carry out a recorded pipeline event (between frames)."""
    name = event["event"]
    if name == "restart":
        pipe.restart_from_buffer()
    elif name == "clip":
        pipe.load_clip(int(event["clip"]))
    elif name == "world_seed":
        load_level(pipe, int(event["seed"]))
    elif name == "bias":
        pipe.kv_cache_attention_bias = float(event["value"])
    elif name == "snapshot":
        BOOKMARKS[pipe] = pipe.get_state()
    elif name == "restore":
        if pipe not in BOOKMARKS:
            raise ValueError("restore event before any snapshot event")
        pipe.load_state(BOOKMARKS[pipe])
    elif name == "ground_truth":
        pipe.ground_truth = bool(event["on"])


def load_actions(spec: str, frames: int | None, seed: int = 0, clips: int | None = None) -> list:
    """``spec``: a built-in name (``random`` or ``random:SEED``) or a JSON-lines file (its clip
    events checked against the world's ``clips`` when known). Returns frames and (for files)
    events, cut after ``frames`` frames."""
    name, _, arg = spec.partition(":")
    if name in BUILTIN:
        if arg and name != "random":
            raise ValueError(f"action script {spec!r}: only 'random' takes a seed ('random:7')")
        if arg and not (arg.isascii() and arg.isdigit()):
            raise ValueError(f"action script {spec!r}: the seed after 'random:' is a whole number ('random:7')")
        return _builtin(name, frames or 64, int(arg) if arg else seed)
    path = Path(spec)
    if not path.is_file():
        close = difflib.get_close_matches(name, list(BUILTIN), n=1)
        why = (f"did you mean {close[0]!r}?" if close and not path.suffix else "it is a folder" if path.is_dir()
               else "no such file" if path.suffix or len(path.parts) > 1 else "")
        raise ValueError(f"--actions {spec!r} is neither a built-in script ({', '.join(BUILTIN)}, random:SEED) "
                         "nor an existing JSON-lines file" + (f" ({why})" if why else ""))
    items = read_action_file(path, clips)
    n = sum(not is_event(x) for x in items)
    if frames is None:
        if n > MAX_FRAMES:
            raise ValueError(f"action file {spec!r} has {n} frames of actions; a run makes at most {MAX_FRAMES}: "
                             f"pass --frames {MAX_FRAMES} or fewer")
        return items
    if frames > n:
        raise ValueError(f"action file {spec!r} has {n} frames of actions but {frames} frames were asked; "
                         f"pass --frames {n} or fewer")
    out, count = [], 0
    for item in items:
        if count == frames:
            break
        out.append(item)
        count += not is_event(item)
    return out
