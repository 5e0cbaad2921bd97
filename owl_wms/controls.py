"""The control schema and the frame format (uint8 RGB <-> [-1, 1]), one home each.

A frame's controls are the mouse motion (dx, dy) and 11 buttons, 0 or 1, in the order of
``BUTTONS`` (the original GameRFT's). Frames leave the library as uint8 RGB [H, W, 3].
"""
from __future__ import annotations

import torch

MOUSE_AXES = ("dx", "dy")
BUTTONS = ("W", "A", "S", "D", "LSHIFT", "SPACE", "R", "F", "E", "LMB", "RMB")
N_BUTTONS = len(BUTTONS)


def as_controls(mouse, buttons) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame's controls, checked: mouse float [2], buttons float [11] of 0/1."""
    m = torch.as_tensor(mouse, dtype=torch.float32).flatten()
    b = torch.as_tensor(buttons, dtype=torch.float32).flatten()
    if m.numel() != len(MOUSE_AXES):
        raise ValueError(f"mouse has {m.numel()} values; expected {len(MOUSE_AXES)} (dx, dy)")
    if b.numel() != N_BUTTONS:
        raise ValueError(f"buttons has {b.numel()} values; expected {N_BUTTONS} in the order {list(BUTTONS)}")
    if not torch.isfinite(m).all():
        raise ValueError(f"mouse {m.tolist()} has non-finite values")
    return m, (b != 0).float()


def no_controls(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` frames of no input: mouse [n, 2] and buttons [n, 11] of zeros."""
    return torch.zeros(n, len(MOUSE_AXES)), torch.zeros(n, N_BUTTONS)


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """[..., 3, H, W] in [-1, 1] -> [..., H, W, 3] uint8 RGB on the CPU."""
    return ((frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).movedim(-3, -1).cpu()


def to_unit(frames: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float in [-1, 1] (the autoencoders' range), the layout kept."""
    return frames.float() / 127.5 - 1
