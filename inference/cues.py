"""What the apps say while something slow happens: the first frame, and each event that
rebuilds the session's history between frames."""
from __future__ import annotations

from owl_wms.settings import Settings


def first_frame_cue(settings: Settings) -> str:
    if settings.compile:
        return "compiling the frame call (about a minute on a CPU, less with a warm compile cache)"
    return "making the first frame"


def event_cue(event: dict) -> str | None:
    """What an event between frames is doing, where it takes long enough to show (None: it doesn't)."""
    name = event.get("event")
    if name == "restart":
        return "restarting from the clip's history"
    if name == "world_seed":
        return f"loading level {event.get('seed')}"
    if name == "clip":
        return f"loading clip {event.get('clip')}"
    if name == "restore":
        return "restoring the snapshot"
    return None
