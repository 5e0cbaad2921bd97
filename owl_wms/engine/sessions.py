"""Several sessions (players or rollouts) served by one model: each denoising step of every
session that makes a frame is one batched model call.

Each session is a ``CausvidPipeline`` with its own history, lifecycle, epoch, noise stream,
bias, recompute anchor, clip replay and snapshots, over its own row of one shared ring cache
(owl_wms/ring.py): its hard cuts, recomputes and observed frames write its row alone, and a
batched call writes each row at its own position under its own mask. Calls are padded to a
power-of-two number of rows, so a compiled model builds one graph per size, not per count of
sessions; a padded or idle row does not commit, and the slot it writes is the one its own next
write replaces, which no query sees before then.
"""
from __future__ import annotations

import torch

from ..controls import N_BUTTONS, to_uint8
from ..settings import Settings
from .build import load_parts, startup_text
from .pipeline import CausvidPipeline
from .runner import ModelRunner


def batch_rows(n: int) -> int:
    """Rows a call over sessions in rows 0..n-1 runs: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class Sessions:
    def __init__(self, model, decoder, world, settings: Settings | None = None, capacity: int = 8,
                 verbose: bool = True, weights: str | None = None):
        if not 1 <= capacity <= 1024:
            raise ValueError(f"sessions capacity {capacity} must be a whole number in [1, 1024]")
        self.settings = settings or Settings.from_config(world.inference)
        self.runner = ModelRunner(model, decoder, world, self.settings)
        if not self.runner.uses_ring:
            raise ValueError(f"several sessions in one call need the in-place ring cache (OWL_RING_MODE=inplace); "
                             f"these settings can't use it: {self.runner.ring_blocker}")
        if self.settings.kv.guard:
            raise ValueError("the ring guard (OWL_RING_GUARD) checks one session's cache; run it without --sessions")
        self.world, self.model, self.decoder, self.weights = world, model, decoder, weights
        self.window, self.alpha, self.schedule = world.pipeline.window_frames, world.pipeline.history_alpha, world.pipeline.schedule
        self.tp = self.stages = None  # sessions run in one process
        self.capacity = capacity
        self.ring = self.runner.new_cache(rows=batch_rows(capacity))
        self.rows: dict[CausvidPipeline, int] = {}  # open sessions -> their ring row
        if verbose:
            n_params = sum(p.numel() for p in model.parameters())
            print(startup_text(self, n_params) + f"\n[owl] sessions: up to {capacity} in one call", flush=True)

    @classmethod
    def from_checkpoint(cls, checkpoint=None, ckpt_path=None, settings: Settings | None = None, capacity: int = 8,
                        verbose: bool = True, weights: str | None = None) -> "Sessions":
        world, model, decoder, described = load_parts(checkpoint, ckpt_path, weights)
        return cls(model, decoder, world, settings, capacity, verbose, described)

    def open(self, seed: int | None = None, clip=0, ground_truth: bool = False) -> CausvidPipeline:
        """A new session in the lowest free row, its history from ``clip`` (None: load one later)
        and its noise from ``seed`` (default: the settings')."""
        free = [r for r in range(self.capacity) if r not in self.rows.values()]
        if not free:
            raise RuntimeError(f"all {self.capacity} sessions are open; close one first")
        settings = self.settings if seed is None else self.settings.replace(seed=seed)
        pipe = CausvidPipeline(self.model, self.decoder, self.world, settings, ground_truth=ground_truth,
                               verbose=False, weights=self.weights, runner=self.runner,
                               cache=self.ring.rows(free[0], free[0] + 1))
        self.rows[pipe] = free[0]
        if clip is not None:
            pipe.load_clip(clip)
        return pipe

    def close(self, pipe: CausvidPipeline) -> None:
        """The session leaves; its row is free for the next one."""
        if self.rows.pop(pipe, None) is None:
            raise ValueError("this session is not open here")

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def step(self, controls: dict) -> dict:
        """One frame for each session in ``controls`` ({session: (mouse, buttons)}, or
        (mouse, buttons, commit)): {session: latent [1, 1, c, h, w]} in model space. Recomputes
        that fall due rebuild their session's row first; then every denoising step is one call."""
        unknown = [p for p in controls if p not in self.rows]
        if unknown:
            raise ValueError(f"{len(unknown)} of the sessions given are not open here")
        order = sorted(controls, key=self.rows.get)
        plans, calls = {}, {}
        for pipe in order:
            mouse, buttons, *commit = controls[pipe]
            plans[pipe] = pipe.plan_frame(mouse, buttons, commit=commit[0] if commit else True)
            calls[pipe] = pipe.write_history(plans[pipe])  # a recompute: this session's row alone
        n = batch_rows(max(self.rows[p] for p in order) + 1)
        cfg, dev, dtype = self.world.model, self.runner.device, self.settings.dtype
        x = torch.zeros(n, 1, cfg.channels, cfg.sample_size, cfg.sample_size, device=dev, dtype=dtype)
        mouse = torch.zeros(n, 1, 2, device=dev, dtype=dtype)
        buttons = torch.zeros(n, 1, N_BUTTONS, device=dev, dtype=dtype)
        commit, bias = torch.zeros(n, dtype=torch.bool), torch.zeros(n)
        for pipe in order:
            r, plan = self.rows[pipe], plans[pipe]
            x[r], mouse[r, 0], buttons[r, 0] = plan.noise[0], plan.mouse, plan.buttons
            commit[r], bias[r] = plan.commit, plan.bias
        before = self.runner.calls
        out = self.runner.denoise(x, mouse, buttons, self.ring.rows(0, n), self.schedule, bias.to(dev), commit.to(dev))
        latents = {}
        for pipe in order:  # each session made its frame in the batch's calls
            latent = latents[pipe] = out[self.rows[pipe]][None]
            pipe.finish_frame(plans[pipe], latent, calls[pipe] + self.runner.calls - before)
        return latents

    @torch.no_grad()
    def decode(self, latents: list[torch.Tensor]) -> torch.Tensor:
        """uint8 RGB frames [n, H, W, 3] of model-space latents [1, 1, c, h, w], decoded together."""
        if self.decoder is None:
            raise RuntimeError("these sessions were built without a decoder")
        x = torch.cat([lat[:, 0] for lat in latents]).float() * self.world.vae_scale
        return to_uint8(self.runner.decoder.decode(x))
