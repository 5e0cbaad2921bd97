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
from ..parallel import ParallelContext, digest, fingerprint
from ..settings import Settings
from .build import load_parts, startup_text
from .pipeline import CausvidPipeline
from .runner import ModelRunner
from .session_stages import SessionsFirstStage, SessionsMesh


def batch_rows(n: int) -> int:
    """Rows a call over sessions in rows 0..n-1 runs: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class Sessions:
    def __init__(self, model, decoder, world, settings: Settings | None = None, capacity: int = 8,
                 verbose: bool = True, weights: str | None = None, pp: ParallelContext | None = None,
                 tp: ParallelContext | None = None):
        """``pp``: this rank's place in two stages (rank 0 plans and decodes every session's
        frames, the mesh makes them: session_stages.py); ``tp``: a mesh rank's place among the
        generating ranks, which split the heads."""
        if not 1 <= capacity <= 1024:
            raise ValueError(f"sessions capacity {capacity} must be a whole number in [1, 1024]")
        self.settings = settings or Settings.from_config(world.inference)
        if pp is not None:  # every rank must have been started alike, with the same (unsharded) weights
            pp.agree(digest(self.settings, world, fingerprint(model)))
        if tp is not None:
            tp.shard(model)
        self.runner = ModelRunner(model, decoder, world, self.settings, tp.local_config(world.model) if tp else None, tp)
        if not self.runner.uses_ring:
            raise ValueError(f"several sessions in one call need the in-place ring cache (OWL_RING_MODE=inplace); "
                             f"these settings can't use it: {self.runner.ring_blocker}")
        if self.settings.kv.guard:
            raise ValueError("the ring guard (OWL_RING_GUARD) checks one session's cache; run it without --sessions")
        self.world, self.model, self.decoder, self.weights = world, model, decoder, weights
        self.window, self.alpha, self.schedule = world.pipeline.window_frames, world.pipeline.history_alpha, world.pipeline.schedule
        self.guidance = world.pipeline.guidance  # every session's planner counts its call from the world too
        self.tp = None  # rank 0 never splits the heads; a mesh that does votes in its stage (SessionsMesh)
        self.stages = None if pp is None else SessionsFirstStage(self, pp) if pp.is_leader else SessionsMesh(self, pp, tp)
        self.capacity = capacity
        self.ring = self.runner.new_cache(rows=batch_rows(capacity))
        self.rows: dict[CausvidPipeline, int] = {}  # open sessions -> their ring row
        if verbose and (pp is None or pp.is_leader):
            n_params = sum(p.numel() for p in model.parameters())
            print(startup_text(self, n_params) + f"\n[owl] sessions: up to {capacity} in one call", flush=True)

    @classmethod
    def from_checkpoint(cls, checkpoint=None, ckpt_path=None, settings: Settings | None = None, capacity: int = 8,
                        verbose: bool = True, weights: str | None = None, pp: ParallelContext | None = None,
                        tp: ParallelContext | None = None) -> "Sessions":
        world, model, decoder, described = load_parts(checkpoint, ckpt_path, weights, pp is None or pp.is_leader)
        return cls(model, decoder, world, settings, capacity, verbose, described, pp, tp)

    def open(self, seed: int | None = None, clip=0, ground_truth: bool = False, row: int | None = None) -> CausvidPipeline:
        """A new session in the lowest free row (or ``row``), its history from ``clip`` (None: load
        one later) and its noise from ``seed`` (default: the settings')."""
        free = [r for r in range(self.capacity) if r not in self.rows.values()]
        if not free or (row is not None and row not in free):
            raise RuntimeError(f"all {self.capacity} sessions are open; close one first" if not free
                               else f"session row {row} is taken")
        row = free[0] if row is None else row
        settings = self.settings if seed is None else self.settings.replace(seed=seed)
        first = isinstance(self.stages, SessionsFirstStage)
        pipe = CausvidPipeline(self.model, self.decoder, self.world, settings, ground_truth=ground_truth,
                               verbose=False, weights=self.weights, runner=self.runner,
                               cache=self.ring.rows(row, row + 1),
                               stage=(lambda p: self.stages.attach(p, row)) if first else None)
        self.rows[pipe] = row
        if clip is not None:
            pipe.load_clip(clip)
        return pipe

    def close(self, pipe: CausvidPipeline) -> None:
        """The session leaves; its row is free for the next one (two stages: after its stop)."""
        if pipe not in self.rows:
            raise ValueError("this session is not open here")
        try:
            pipe.close()
        finally:
            del self.rows[pipe]

    def shut_down(self) -> None:
        """Rank 0 of two stages: the generating rank stops (every session closed first)."""
        if isinstance(self.stages, SessionsFirstStage):
            for pipe in list(self.rows):
                self.close(pipe)
            self.stages.stop()

    def follow(self) -> int:
        """The generating rank of two stages: rank 0's steps until it shuts down."""
        return self.stages.follow()

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
        plans = {}
        for pipe in sorted(controls, key=self.rows.get):
            mouse, buttons, *commit = controls[pipe]
            plans[pipe] = pipe.plan_frame(mouse, buttons, commit=commit[0] if commit else True)
        if self.stages is not None:  # rank 0 of two stages: the generating rank runs them
            return self.stages.step(plans)
        return self.run(plans)[0]

    @torch.no_grad()
    def run(self, plans: dict) -> tuple[dict, dict]:
        """Run one step's frame plans ({session: plan}, in row order): ({session: latent}, {session:
        model calls}). Recomputes rebuild their session's row first; then every denoising step is
        one call."""
        order, calls = list(plans), {}
        for pipe in order:
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
        out = self.runner.denoise(x, mouse, buttons, self.ring.rows(0, n), self.schedule, bias.to(dev), commit.to(dev),
                                   guidance=self.guidance)
        latents = {}
        for pipe in order:  # each session made its frame in the batch's calls
            latent = latents[pipe] = out[self.rows[pipe]][None]
            calls[pipe] += self.runner.calls - before
            pipe.finish_frame(plans[pipe], latent, calls[pipe])
        return latents, calls

    @torch.no_grad()
    def decode(self, latents: list[torch.Tensor]) -> torch.Tensor:
        """uint8 RGB frames [n, H, W, 3] of model-space latents [1, 1, c, h, w], decoded together."""
        if self.decoder is None:
            raise RuntimeError("these sessions were built without a decoder")
        x = torch.cat([lat[:, 0] for lat in latents]).float() * self.world.vae_scale
        return to_uint8(self.runner.decoder.decode(x))
