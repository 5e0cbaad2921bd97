"""What a session does next, as ``StepPlan``s (lifecycle.py): the inputs of each step - a new
history, an observed frame, or a frame's controls, noise and due recompute - drawn from the
session's own lifecycle, noise stream, recompute anchor and clip replay. The pipeline runs the
plans (pipeline.py); a batch of sessions runs many in one call (sessions.py)."""
from __future__ import annotations

from typing import Callable

import torch

from ..config import WorldConfig, check_guidance, check_schedule
from ..controls import as_controls
from ..sampler import NoiseStream
from ..settings import Settings
from .anchor import RecomputeAnchor
from .lifecycle import Lifecycle, Phase, StepPlan, check_history
from .replay import ClipReplay


def calls_per_frame(schedule, guidance: float) -> int:
    """Model calls a generated frame makes: a step each, and the rest call of guidance."""
    return len(schedule) - 1 + (guidance != 1)


class FramePlanner:
    def __init__(self, world: WorldConfig, settings: Settings, noise_device, ground_truth: bool = False):
        cfg, p = world.model, world.pipeline
        self.cfg, self.window, self.alpha, self.recompute_from = cfg, p.window_frames, p.history_alpha, settings.kv_recompute_anchor
        self._schedule, self._guidance = check_schedule(p.schedule), check_guidance(p.guidance)
        self.lifecycle = Lifecycle(calls_per_frame(self._schedule, self._guidance), settings.kv_recompute_every,
                                   settings.kv_cache_attention_bias)
        self.noise = NoiseStream(settings.seed, noise_device, (1, 1, cfg.channels, cfg.sample_size, cfg.sample_size))
        self.recompute_anchor, self.replay = RecomputeAnchor(self.window), ClipReplay(world, ground_truth)
        self.last_controls = None  # (mouse, buttons) the last frame used: the player's or the clip's (GT)

    @property
    def schedule(self) -> tuple[float, ...]:
        """The sampler's t_0 = 1 > ... > t_K = 0 (evaluation swaps in a many-step Euler one)."""
        return self._schedule

    @schedule.setter
    def schedule(self, value):
        self._schedule = check_schedule(value)
        self.lifecycle.n_steps = calls_per_frame(self._schedule, self._guidance)

    @property
    def guidance(self) -> float:
        """The first step's control guidance (PipelineConfig.guidance; 1: none)."""
        return self._guidance

    @guidance.setter
    def guidance(self, value):
        self._guidance = check_guidance(value)
        self.lifecycle.n_steps = calls_per_frame(self._schedule, self._guidance)

    def check(self, history, mouse=None, buttons=None):
        """(history, mouse, buttons) of a new history, controls defaulting to none; or a clear error."""
        return check_history(history, mouse, buttons, window=self.window, channels=self.cfg.channels,
                             size=self.cfg.sample_size)

    def cut(self, history: torch.Tensor, mouse, buttons, noised: bool = False) -> StepPlan:
        """A hard cut to ``history`` [n, c, h, w] in model space (``noised``: already the noised
        model input, which anchors no recompute)."""
        history, mouse, buttons = self.check(history, mouse, buttons)
        self.recompute_anchor.restart(*(() if noised else (history, mouse, buttons)))
        x = history.float().to(self.noise.generator.device) if noised else self.noise.noised(history, self.alpha)
        self.replay.restart()
        return self.lifecycle.cut(x, mouse.float().cpu(), buttons.float().cpu())

    def observe(self, latent: torch.Tensor, mouse, buttons) -> StepPlan:
        """A real frame (model space [1, 1, c, h, w]) joins the history, noised at alpha like the prefill."""
        m, b = as_controls(mouse, buttons)
        clean = latent.reshape(1, *latent.shape[-3:]).float().cpu()
        plan = self.lifecycle.observe(self.noise.noised(clean, self.alpha), m[None], b[None])
        self.recompute_anchor.add(clean[0], m, b)
        return plan

    def frame(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True,
              reencode: Callable | None = None) -> StepPlan:
        """The next frame: the controls (the clip's in ground-truth mode), a recompute's anchor if
        one is due (kv_recompute_every; its noise drawn first; ``reencode`` makes decoded-and-encoded
        latents of it where kv_recompute_anchor is "decoded"), the noise."""
        if self.lifecycle.phase is Phase.EMPTY:
            raise RuntimeError("pipeline has no history; call load_clip(), hard_cut() or prefill() first")
        mouse, buttons = self.last_controls = self.replay.controls(mouse, buttons)
        anchor = None
        if commit and self.lifecycle.recompute_due and self.recompute_anchor:
            lat, am, ab = self.recompute_anchor.stacked()
            lat = reencode(lat) if self.recompute_from == "decoded" else lat  # what the player saw
            anchor = (self.noise.noised(lat, self.alpha), am, ab)
        noise = self.noise() if noise is None else noise.float().to(self.noise.generator.device)
        return self.lifecycle.frame(mouse.float(), buttons.float(), noise, commit, anchor)

    def finish(self, plan: StepPlan, latent: torch.Tensor | None, calls: int) -> None:
        """After ``plan`` ran in ``calls`` model calls, making ``latent`` [1, 1, c, h, w] (or none):
        the anchor takes a committed frame; the lifecycle checks the count."""
        if latent is not None and plan.commit:
            self.recompute_anchor.add(latent[0, 0], plan.mouse, plan.buttons)
        self.lifecycle.finish(plan, calls)
