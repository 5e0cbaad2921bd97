"""Action scripts for rollouts: built-in names and a JSON-lines file format.

File format: one JSON object per line, ``{"mouse": [dx, dy], "buttons": [11 ints]}``,
buttons in the order W A S D LSHIFT SPACE R F E LMB RMB. Blank lines are skipped.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .causvid_pipeline import BUTTONS

Action = tuple[list[float], list[int]]
BUILTIN = ("idle", "forward", "turn", "walk_turn", "random")


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


def parse_action(obj, where: str) -> Action:
    if not isinstance(obj, dict) or "mouse" not in obj or "buttons" not in obj:
        raise ValueError(f"{where}: expected {{\"mouse\": [dx, dy], \"buttons\": [11 ints]}}, got {obj!r}")
    mouse, buttons = obj["mouse"], obj["buttons"]
    if (not isinstance(mouse, list) or len(mouse) != 2
            or not all(isinstance(v, (int, float)) and np.isfinite(v) for v in mouse)):
        raise ValueError(f"{where}: mouse must be 2 finite numbers, got {mouse!r}")
    if not isinstance(buttons, list) or len(buttons) != len(BUTTONS) or not all(v in (0, 1) for v in buttons):
        raise ValueError(f"{where}: buttons must be {len(BUTTONS)} values of 0/1 "
                         f"({' '.join(BUTTONS)}), got {buttons!r}")
    return [float(v) for v in mouse], [int(v) for v in buttons]


def read_action_file(path: str | Path) -> list[Action]:
    path = Path(path)
    actions = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
        actions.append(parse_action(obj, f"{path}:{i}"))
    if not actions:
        raise ValueError(f"action file {str(path)!r} holds no actions")
    return actions


def write_action_file(path: str | Path, actions: list[Action]):
    Path(path).write_text("".join(json.dumps({"mouse": m, "buttons": b}) + "\n" for m, b in actions))


def load_actions(spec: str, frames: int | None, seed: int = 0) -> list[Action]:
    """``spec``: a built-in name (``random`` or ``random:SEED``) or a JSON-lines file."""
    name, _, arg = spec.partition(":")
    if name in BUILTIN:
        if arg and (name != "random" or not arg.isdigit()):
            raise ValueError(f"action script {spec!r}: only 'random' takes a seed ('random:7')")
        return _builtin(name, frames or 64, int(arg) if arg else seed)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--actions {spec!r} is neither a built-in script ({', '.join(BUILTIN)}) "
                         "nor an existing JSON-lines file")
    actions = read_action_file(path)
    if frames is not None and frames > len(actions):
        raise ValueError(f"action file {spec!r} has {len(actions)} actions but {frames} frames were asked; "
                         f"pass --frames {len(actions)} or fewer")
    return actions[:frames] if frames else actions
