"""CausVid two-step streaming pipeline (ARCHITECTURE Part 2).

Prefill the window with the noised history at t = alpha (cache writes on); then each frame:
z ~ N(0, I) -> v1 = model(z, 1) (writes off) -> x = z - 0.75 v1 -> v2 = model(x, 0.25)
(writes on: this frame enters the window) -> x0 = x - 0.25 v2 -> decode(x0 * vae_scale).
The schedule generalises to any t_0 = 1 > ... > t_K = 0; the cache is written at the last step.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from owl_wms.cache import QuantizedStaticCache, build_cache, describe_plan, plan_layers
from owl_wms.clips import Clip, list_clips, load_clip
from owl_wms.config import WorldConfig, load_config
from owl_wms.loading import build_model, load_weights, read_state_dict
from owl_wms.settings import KVSettings, Settings
from owl_wms.vae import FrameDecoder, load_decoder

from .profiler import KVProfiler

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "maze-world"
BUTTONS = ("W", "A", "S", "D", "LSHIFT", "SPACE", "R", "F", "E", "LMB", "RMB")


def as_controls(mouse, buttons) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.as_tensor(mouse, dtype=torch.float32).flatten()
    b = torch.as_tensor(buttons, dtype=torch.float32).flatten()
    if m.numel() != 2:
        raise ValueError(f"mouse has {m.numel()} values; expected 2 (dx, dy)")
    if b.numel() != len(BUTTONS):
        raise ValueError(f"buttons has {b.numel()} values; expected {len(BUTTONS)} in the order {list(BUTTONS)}")
    if not torch.isfinite(m).all():
        raise ValueError(f"mouse {m.tolist()} has non-finite values")
    return m, (b != 0).float()


def to_uint8(frame: torch.Tensor) -> torch.Tensor:
    """[3, H, W] in [-1, 1] -> [H, W, 3] uint8 RGB on the CPU."""
    return ((frame.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu()


class CausvidPipeline:
    def __init__(self, model, decoder: FrameDecoder | None, world: WorldConfig, settings: Settings | None = None,
                 clip: Clip | None = None, ground_truth: bool = False, verbose: bool = True):
        self.world = world
        self.settings = settings or Settings.resolve(world.inference)
        s = self.settings
        self.cfg = world.model
        self.window = world.pipeline.window_frames
        self.alpha = world.pipeline.history_alpha
        self.schedule = world.pipeline.schedule
        self.vae_scale = world.vae_scale
        self.device = torch.device(s.device)
        self.model = model.to(self.device, s.dtype).eval()
        self.model.core.transformer.set_backends(s.attn_backend, s.attn_backend_decode)
        if s.compile:
            # Only the transformer is compiled: RoPE angles and cache bookkeeping run eagerly
            # around it, so decode shapes are static and nothing recompiles per frame.
            self.model.core.transformer.compile(dynamic=False)
            if verbose and s.device == "cpu" and "flex" in (s.attn_backend, s.attn_backend_decode):
                print("[owl] compile: FlexAttention stays eager on CPU (inductor's CPU lowering fails for these "
                      "shapes); the rest of every block is compiled", flush=True)
        self.core = self.model.core
        self.decoder = decoder.to(self.device).eval() if decoder is not None else None
        self.generator = torch.Generator().manual_seed(s.seed)
        # The per-layer cache plan is built (and checked against the model) at start-up.
        self.kv_plan = plan_layers(self.cfg, s.kv, self.window) if s.kv_cache != "none" else None
        self.profiler = KVProfiler(s.device, s.profile_kv_first, s.profile_kv_every) if s.profile_kv else None
        if self.profiler and not s.compile:  # compiled blocks cannot be timed from outside
            for block in self.core.transformer.blocks:
                self.profiler.instrument(block.attn, "attend_out", "attn")
        self.ground_truth = ground_truth
        self.cache = None
        self._recompute = None  # no-cache baseline state (OWL_KV_CACHE=none)
        self.clip = None
        self.frame_index = 0
        self.gt_step = 0
        # No-cache baseline: each frame's cache-writing input, enough frames to cover the
        # receptive field (n_layers * (W-1) + 1), since deep-layer K/V carry older context.
        self._recompute_frames = self.cfg.n_layers * (self.window - 1) + 1
        self.verbose = verbose
        self.last_velocity = None
        self._guard_reported = False
        if verbose:
            print(self.describe(), flush=True)
        if clip is not None:
            self.load_clip(clip)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint=None, ckpt_path=None, settings: Settings | None = None, clip=0,
                        ground_truth: bool = False, verbose: bool = True) -> "CausvidPipeline":
        """``checkpoint``: a checkpoint folder (with config.yaml) or a config file."""
        checkpoint = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
        cfg_path = checkpoint / "config.yaml" if checkpoint.is_dir() else checkpoint
        world = load_config(cfg_path)
        settings = settings or Settings.resolve(world.inference)
        ckpt_path = Path(ckpt_path) if ckpt_path is not None else cfg_path.parent / "model.safetensors"
        model = load_weights(build_model(world.model), read_state_dict(ckpt_path), str(ckpt_path))
        pipe = cls(model, load_decoder(world), world, settings, ground_truth=ground_truth, verbose=verbose)
        if clip is not None:
            pipe.load_clip(clip)
        return pipe

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        label = "" if self.world.trained else " UNTRAINED (random weights: frames show noise)"
        sched = ">".join(f"{t:g}" for t in self.schedule)
        text = (f"[owl] world={self.world.name}{label} params={n / 1e6:.1f}M window={self.window} "
                f"alpha={self.alpha} schedule={sched} | {self.settings.describe()}")
        if self.kv_plan is not None and self.settings.kv != KVSettings():
            text += f"\n[owl] kv plan: {describe_plan(self.kv_plan)}"
        return text

    @property
    def clip_paths(self) -> list[Path]:
        folder = self.world.resolve(self.world.pipeline.clips)
        return list_clips(folder) if folder is not None and folder.is_dir() else []

    # -- history ---------------------------------------------------------------------------------
    def load_clip(self, clip=0):
        """Start from a clip: an index into the checkpoint's clips, a path, or a ``Clip``."""
        if not isinstance(clip, Clip):
            if isinstance(clip, int):
                paths = self.clip_paths
                if not paths:
                    raise FileNotFoundError(f"world {self.world.name!r} has no clips "
                                            f"(pipeline.clips={self.world.pipeline.clips!r})")
                clip = paths[clip % len(paths)]
            clip = load_clip(clip, self.cfg.channels, self.cfg.sample_size)
        self.clip = clip
        self.restart_from_buffer()
        return clip

    def load_world(self, seed: int, future: int = 1000):
        """Start from a fresh simulator level: render a history window with the exploring
        policy, encode it with the autoencoder, and keep ``future`` policy actions for
        ground-truth replay."""
        from owl_wms.data import level_clip

        if self.decoder is None:
            raise RuntimeError("starting from a simulator level needs the autoencoder (no decoder loaded)")
        clip, _ = level_clip(self.decoder, seed, self.window, future, self.frame_shape[0], name=f"world-{seed}")
        return self.load_clip(clip)

    @property
    def frame_shape(self) -> tuple[int, int]:
        """(H, W) of decoded frames."""
        if not hasattr(self, "_frame_shape"):
            c, s = self.cfg.channels, self.cfg.sample_size
            self._frame_shape = tuple(self.decode(torch.zeros(1, 1, c, s, s)).shape[:2])
        return self._frame_shape

    def restart_from_buffer(self):
        """Rebuild the cache from the current clip's history; the noise seed restarts too."""
        if self.clip is None:
            raise RuntimeError("no clip loaded; call load_clip() first")
        latents, mouse, buttons = self.clip.history(self.window)
        self.generator.manual_seed(self.settings.seed)
        self.prefill(latents / self.vae_scale, mouse, buttons)

    @torch.no_grad()
    def prefill(self, history: torch.Tensor, mouse: torch.Tensor, buttons: torch.Tensor, noised: bool = False):
        """history [n, c, h, w] in model space (already divided by vae_scale), n <= window.

        ``noised``: the history is already the noised model input (used by parity tests).
        """
        n = history.shape[0]
        if history.ndim != 4 or n > self.window or mouse.shape != (n, 2) or buttons.shape != (n, 11):
            raise ValueError(f"prefill got history {tuple(history.shape)}, mouse {tuple(mouse.shape)}, buttons "
                             f"{tuple(buttons.shape)}; expected [n<= {self.window}, c, h, w], [n, 2], [n, 11]")
        x = history.float() if noised else self._noised_history(history)
        x, t = self._dev(x[None]), self._dev(torch.full((1, n), self.alpha))
        m, b = self._dev(mouse[None]), self._dev(buttons[None])
        self.frame_index = 0
        self.gt_step = 0
        if self.profiler:
            self.profiler.start()
        self.model.core.transformer.disable_decoding()
        if self.settings.kv_cache == "none":
            self.cache = None
            self._recompute = {"x": x, "t": t, "mouse": m, "buttons": b, "start": 0}
        else:
            if self.cache is None:
                self.cache = build_cache(self.cfg, self.settings, self.window, plans=self.kv_plan)
                if self.profiler and isinstance(self.cache, QuantizedStaticCache):
                    self.profiler.instrument(self.cache, "_encode", "quant")
                    self.profiler.instrument(self.cache, "_decode", "dequant")
            else:
                self.cache.reset(1)
            self.cache.enable_cache_updates()
            self.core(x, t, m, b, kv_cache=self.cache)
            self.cache.disable_cache_updates()
        self.model.core.transformer.enable_decoding()
        if self.profiler:
            self.profiler.prefill(self.kv_bytes)

    # -- generation ----------------------------------------------------------------------------
    def _noised_history(self, x: torch.Tensor) -> torch.Tensor:
        """History frames enter the cache noised at alpha: (1 - alpha) x + alpha eps (CPU noise)."""
        x = x.float().cpu()
        return (1 - self.alpha) * x + self.alpha * torch.randn(x.shape, generator=self.generator)

    def _dev(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, self.settings.dtype)

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    def _velocity(self, x, t, m, b, write: bool):
        if self.cache is not None:
            if write:
                self.cache.enable_cache_updates()
            try:
                return self.core(x, t, m, b, kv_cache=self.cache)
            finally:
                self.cache.disable_cache_updates()
        r = self._recompute
        cat = lambda key, new: torch.cat([r[key], new], dim=1)  # noqa: E731
        xs, ts, ms, bs = cat("x", x), cat("t", t), cat("mouse", m), cat("buttons", b)
        v = self.core(xs, ts, ms, bs, frame_offset=r["start"], window_cap=self.window)[:, -1:]
        if write:
            drop = max(xs.shape[1] - self._recompute_frames, 0)
            self._recompute = {"x": xs[:, drop:], "t": ts[:, drop:], "mouse": ms[:, drop:],
                               "buttons": bs[:, drop:], "start": r["start"] + drop}
        return v

    def next_controls(self, mouse, buttons) -> tuple[torch.Tensor, torch.Tensor]:
        """The controls this frame uses: the player's, or the clip's recorded ones in GT mode."""
        if self.ground_truth:
            recorded = 0 if self.clip is None else self.clip.future_mouse.shape[0]
            if self.gt_step >= recorded:
                raise ValueError(f"ground-truth replay exhausted: the clip records {recorded} future actions; "
                                 f"ask for at most {recorded} frames or restart the clip")
            return self.clip.future_mouse[self.gt_step], self.clip.future_buttons[self.gt_step]
        return as_controls(mouse, buttons)

    @torch.no_grad()
    def observe(self, latent: torch.Tensor, mouse, buttons):
        """Teacher forcing: append a real frame (model space [1, 1, c, h, w]) to the history,
        noised at alpha like the prefill, in place of a generated one."""
        m, b = as_controls(mouse, buttons)
        x = self._noised_history(latent)
        t = self._dev(torch.full((1, 1), self.alpha))
        self.model.core.transformer.disable_decoding()
        self._velocity(self._dev(x), t, self._dev(m.view(1, 1, 2)), self._dev(b.view(1, 1, 11)), write=True)
        self.model.core.transformer.enable_decoding()
        self.frame_index += 1

    @torch.no_grad()
    def generate(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True) -> torch.Tensor:
        """One frame in model space: latent [1, 1, c, h, w] (not yet multiplied by vae_scale).

        ``commit=False`` leaves the history untouched (for teacher forcing with ``observe``)."""
        if self.cache is None and self._recompute is None:
            raise RuntimeError("pipeline has no history; call load_clip() or prefill() first")
        mouse, buttons = self.next_controls(mouse, buttons)
        if self.ground_truth:
            self.gt_step += 1
        m, b = self._dev(mouse.view(1, 1, 2)), self._dev(buttons.view(1, 1, 11))
        c, s = self.cfg.channels, self.cfg.sample_size
        if noise is None:
            noise = torch.randn((1, 1, c, s, s), generator=self.generator)
        x = self._dev(noise)
        sched = self.schedule
        for i in range(len(sched) - 1):
            t = self._dev(torch.full((1, 1), sched[i]))
            v = self._velocity(x, t, m, b, write=commit and i == len(sched) - 2)
            x = x - (sched[i] - sched[i + 1]) * v
            self.last_velocity = v  # the last step's prediction (A/B runs compare it)
            if self.profiler:
                self.profiler.mark(f"step{i + 1}")
        self.frame_index += commit
        if self.verbose and not self._guard_reported and hasattr(self.cache, "guard_report"):
            report = self.cache.guard_report()
            if report:
                print(report, flush=True)
                self._guard_reported = True
        return x

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise RuntimeError("this pipeline was built without a decoder")
        return to_uint8(self.decoder.decode(latent[:, 0].float() * self.vae_scale)[0])

    @torch.no_grad()
    def __call__(self, mouse, buttons) -> tuple[torch.Tensor, float]:
        """mouse [2], buttons [11] (order W A S D LSHIFT SPACE R F E LMB RMB) ->
        (uint8 RGB frame [H, W, 3], wall seconds for denoising + decoding)."""
        start = time.perf_counter()
        if self.profiler:
            self.profiler.start()
        frame = self.decode(self.generate(mouse, buttons))
        if self.profiler:
            self.profiler.mark("decoder")
            self.profiler.frame(self.kv_bytes, self.cache.scale_nbytes() if self.cache is not None else 0)
        return frame, time.perf_counter() - start
