"""The recompute anchor: the last ``window`` committed clean frames (model-space latent, mouse,
buttons), from which a recompute (the kv_recompute_every setting) rebuilds the cache."""
from __future__ import annotations

import collections

import torch


class RecomputeAnchor:
    def __init__(self, window: int):
        self.frames: collections.deque = collections.deque(maxlen=window)

    def restart(self, history=None, mouse=None, buttons=None):
        """Empty, or the frames of a new history (none for a history given already noised)."""
        self.frames.clear()
        if history is not None:
            self.frames.extend(zip(history.float().cpu(), mouse.float().cpu(), buttons.float().cpu()))

    def add(self, latent: torch.Tensor, mouse: torch.Tensor, buttons: torch.Tensor):
        self.frames.append((latent.float().cpu(), mouse.float().cpu(), buttons.float().cpu()))

    def __len__(self) -> int:
        return len(self.frames)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latents [n, c, h, w], mouse [n, 2], buttons [n, 11])."""
        if not self.frames:
            raise RuntimeError("no committed frames to anchor a recompute (the history was given pre-noised)")
        lat, m, b = (torch.stack(t) for t in zip(*self.frames))
        return lat, m, b

    def state(self) -> tuple[dict, dict]:
        """(tensors, metadata) for a snapshot."""
        tensors = {f"{i}.{name}": t for i, frame in enumerate(self.frames)
                   for name, t in zip(("latent", "mouse", "buttons"), frame)}
        return tensors, {"frames": len(self.frames)}

    def restore(self, tensors: dict, meta: dict) -> None:
        self.frames.clear()
        self.frames.extend(tuple(tensors[f"{i}.{name}"].clone() for name in ("latent", "mouse", "buttons"))
                           for i in range(meta["frames"]))
