"""Where a pipeline's history and controls come from: the clip it started from (an index into
its world's clips, a path, or a ``Clip``) and ground-truth replay of the clip's recorded actions
in place of the player's."""
from __future__ import annotations

from pathlib import Path

import torch

from ..clips import Clip, clip_path, load_clip, world_clips
from ..config import WorldConfig
from ..controls import as_controls


class ClipReplay:
    def __init__(self, world: WorldConfig, on: bool = False):
        self.world, self.on = world, on  # on: replay the recorded actions (ground truth)
        self.clip: Clip | None = None
        self.step = 0  # recorded actions used since the last restart

    @property
    def paths(self) -> list[Path]:
        """The world's clips (its config's ``pipeline.clips`` folder)."""
        return world_clips(self.world)

    def load(self, clip) -> Clip:
        """``clip``: an index into ``paths``, a path, or a ``Clip``."""
        if isinstance(clip, int):
            clip = clip_path(self.world, clip)
        cfg = self.world.model
        self.clip = clip if isinstance(clip, Clip) else load_clip(clip, cfg.channels, cfg.sample_size)
        return self.clip

    def set_on(self, on: bool) -> None:
        """Turned on, the clip's recorded actions replay from their start."""
        self.on, self.step = bool(on), 0 if on else self.step

    def restart(self) -> None:
        """A new history: the recorded actions start over."""
        self.step = 0

    def history(self, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The clip's last ``window`` history frames: (latents, mouse, buttons)."""
        if self.clip is None:
            raise RuntimeError("no clip loaded; call load_clip() first")
        return self.clip.history(window)

    def controls(self, mouse, buttons) -> tuple[torch.Tensor, torch.Tensor]:
        """The controls the next frame uses: the player's, or the clip's next recorded ones."""
        if not self.on:
            return as_controls(mouse, buttons)
        recorded = 0 if self.clip is None else self.clip.future_frames
        if self.step >= recorded:
            raise ValueError(f"ground-truth replay exhausted: the clip records {recorded} future actions; "
                             f"ask for at most {recorded} frames or restart the clip")
        self.step += 1
        return self.clip.future_mouse[self.step - 1], self.clip.future_buttons[self.step - 1]

    def state(self) -> tuple[dict, dict]:
        return {}, {"step": self.step, "on": self.on, "clip": self.clip.name if self.clip is not None else None}

    def restore(self, tensors: dict, meta: dict) -> None:
        self.step, self.on = meta["step"], meta["on"]
