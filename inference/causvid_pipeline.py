"""CausVid two-step streaming pipeline (ARCHITECTURE Part 2).

Prefill the window with the noised history at t = alpha (cache writes on); then each frame:
z ~ N(0, I) -> v1 = model(z, 1) (writes off) -> x = z - 0.75 v1 -> v2 = model(x, 0.25)
(writes on: this frame enters the window) -> x0 = x - 0.25 v2 -> decode(x0 * vae_scale).
The schedule generalises to any t_0 = 1 > ... > t_K = 0; the cache is written at the last step.

Every step is a ``StepPlan`` from the cache lifecycle (inference/lifecycle.py): hard cuts,
recomputes, observed frames and generated frames all run through ``_run``, the only code
that touches the cache. With tensor parallelism the plan is broadcast from rank 0.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from owl_wms.cache import QuantizedStaticCache, build_cache, describe_plan, plan_layers
from owl_wms.clips import Clip, list_clips, load_clip
from owl_wms.config import WorldConfig, load_config
from owl_wms.loading import build_model, load_weights, read_weights
from owl_wms.parallel import ParallelContext, TPError, digest, fingerprint, is_collective_error
from owl_wms.settings import KVSettings, Settings
from owl_wms.vae import FrameDecoder, load_decoder

from .lifecycle import Lifecycle, LifecycleError, Phase, StepPlan
from .profiler import KVProfiler

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "maze-world"
BUTTONS = ("W", "A", "S", "D", "LSHIFT", "SPACE", "R", "F", "E", "LMB", "RMB")
STATE_FORMAT = "owl-pipeline-state/1"
TP_FAULTS = ("settings", "calls", "raise", "envelope")  # test-only: what rank 1 breaks (--tp-fault)


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
                 clip: Clip | None = None, ground_truth: bool = False, verbose: bool = True,
                 tp: ParallelContext | None = None, tp_fault: str | None = None, weights: str | None = None):
        self.world = world
        self.weights = weights  # which weights of the checkpoint were loaded (said in the start-up line)
        self.settings = settings or Settings.resolve(world.inference)
        s = self.settings
        self.cfg = world.model
        self.window = world.pipeline.window_frames
        self.alpha = world.pipeline.history_alpha
        self.lifecycle = Lifecycle(len(world.pipeline.schedule) - 1, s.kv_recompute_every, s.kv_cache_attention_bias)
        self.schedule = world.pipeline.schedule
        self.vae_scale = world.vae_scale
        self.device = torch.device(s.device)
        self.tp = tp
        self.fault = tp_fault if tp is not None and tp.rank == 1 else None
        self.n_params = sum(p.numel() for p in model.parameters())  # the whole model, before any sharding
        if tp is not None:
            tp.check_divisible(self.cfg)
            weights = fingerprint(model)
            # Start-up tripwire: every rank must run the same settings, config and weights.
            mine = digest(s if self.fault != "settings" else s.replace(seed=s.seed + 1), world, weights)
            tp.agree(mine)
            tp.shard(model)
        # The cache sees this rank's heads only (all of them without tensor parallelism).
        self.cache_cfg = tp.local_config(self.cfg) if tp is not None else self.cfg
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
        self.kv_plan = plan_layers(self.cache_cfg, s.kv, self.window) if s.kv_cache != "none" else None
        # Under tensor parallelism rank 0 profiles (its comm time includes waiting for the others).
        profile = s.profile_kv and (tp is None or tp.is_leader)
        self.profiler = KVProfiler(s.device, s.profile_kv_first, s.profile_kv_every) if profile else None
        if self.profiler and not s.compile:  # compiled blocks cannot be timed from outside
            for block in self.core.transformer.blocks:
                self.profiler.instrument(block.attn, "attend_out", "attn")
        if self.profiler and tp is not None:  # all-reduces in the model + the envelope exchange and checks
            for method in ("all_reduce", "exchange", "check_scalars"):
                self.profiler.instrument(tp, method, "comm")
        self._anchor: collections.deque = collections.deque(maxlen=self.window)  # committed clean frames
        self._step_error: str | None = None  # TP: a problem found after a step, voted on at the next one
        self.ground_truth = ground_truth
        self.cache = None
        self._nocache = None  # no-cache baseline state (OWL_KV_CACHE=none)
        self.clip = None
        self.gt_step = 0
        # No-cache baseline: each frame's cache-writing input, enough frames to cover the
        # receptive field (n_layers * (W-1) + 1), since deep-layer K/V carry older context.
        self._nocache_frames = self.cfg.n_layers * (self.window - 1) + 1
        self.verbose = verbose and (tp is None or tp.is_leader)
        self.last_velocity = None
        self.last_controls = None  # (mouse, buttons) the last frame used: the player's or the clip's (GT)
        self._guard_reported = False
        if self.verbose:
            print(self.describe(), flush=True)
        if clip is not None:
            self.load_clip(clip)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, checkpoint=None, ckpt_path=None, settings: Settings | None = None, clip=0,
                        ground_truth: bool = False, verbose: bool = True, tp: ParallelContext | None = None,
                        tp_fault: str | None = None, weights: str | None = None) -> "CausvidPipeline":
        """``checkpoint``: a checkpoint folder (with config.yaml) or a config file. ``weights``:
        "ema" or "online" for a trainer checkpoint holding both (default: EMA where present).
        Under tensor parallelism only rank 0 loads the autoencoder (it owns decoding and output)."""
        checkpoint = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
        cfg_path = checkpoint / "config.yaml" if checkpoint.is_dir() else checkpoint
        world = load_config(cfg_path)
        settings = settings or Settings.resolve(world.inference)
        ckpt_path = Path(ckpt_path) if ckpt_path is not None else cfg_path.parent / "model.safetensors"
        loaded = read_weights(ckpt_path, weights)
        model = load_weights(build_model(world.model), loaded.tensors, str(ckpt_path))
        decoder = load_decoder(world) if tp is None or tp.is_leader else None
        pipe = cls(model, decoder, world, settings, ground_truth=ground_truth, verbose=verbose, tp=tp,
                   tp_fault=tp_fault, weights=loaded.describe())
        if clip is not None and (tp is None or tp.is_leader):
            pipe.load_clip(clip)
        return pipe

    def describe(self) -> str:
        n = self.n_params
        label = "" if self.world.trained else " UNTRAINED (random weights: frames show noise)"
        sched = ">".join(f"{t:g}" for t in self.schedule)
        local = sum(p.numel() for p in self.model.parameters())
        per_rank = f" (rank 0 holds {local / 1e6:.1f}M)" if self.tp is not None else ""
        weights = f" weights={self.weights}" if self.weights else ""
        text = (f"[owl] world={self.world.name}{label} params={n / 1e6:.1f}M{per_rank}{weights} "
                f"rope={self.cfg.rope_impl} window={self.window} alpha={self.alpha} schedule={sched} | "
                f"{self.settings.describe()}")
        if self.tp is not None:
            text += (f"\n[owl] tensor parallel: {self.tp.world} ranks, {self.cache_cfg.n_heads} of "
                     f"{self.cfg.n_heads} heads per rank, lifecycle check every {self.tp.check_every} steps")
        if self.kv_plan is not None and self.settings.kv != KVSettings():
            text += f"\n[owl] kv plan: {describe_plan(self.kv_plan)}"
        return text

    @property
    def clip_paths(self) -> list[Path]:
        folder = self.world.resolve(self.world.pipeline.clips)
        return list_clips(folder) if folder is not None and folder.is_dir() else []

    @property
    def schedule(self) -> tuple[float, ...]:
        return self._schedule

    @schedule.setter
    def schedule(self, value):
        """The sampler's t_0 = 1 > ... > t_K = 0 (evaluation swaps in a many-step Euler one)."""
        value = tuple(float(t) for t in value)
        if len(value) < 2 or value[0] != 1.0 or value[-1] != 0.0 or any(a <= b for a, b in zip(value, value[1:])):
            raise ValueError(f"schedule {value} must fall strictly from 1 to 0")
        self._schedule = value
        self.lifecycle.n_steps = len(value) - 1

    @property
    def cache_epoch(self) -> int:
        """Increments at every hard cut (a new history); 0 before the first."""
        return self.lifecycle.epoch

    @property
    def frame_index(self) -> int:
        """Frames added to the history since the last hard cut (generated or observed)."""
        return self.lifecycle.frame_index

    @property
    def kv_cache_attention_bias(self) -> float:
        return self.lifecycle.bias

    @kv_cache_attention_bias.setter
    def kv_cache_attention_bias(self, value: float):
        """Soft forgetting, live: from the next step, cached history keys get this logit bias."""
        v = float(value)
        if not -100 <= v <= 100:
            raise ValueError(f"kv_cache_attention_bias={value!r} must be a number in [-100, 100] (0: off)")
        self.lifecycle.bias = v

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
        clip, _ = level_clip(self.decoder, seed, self.window, future, self.sim_config, name=f"world-{seed}")
        return self.load_clip(clip)

    @property
    def sim_config(self):
        """The simulator of this world's levels (its config's ``simulator:``) at the decoded frame size."""
        return self.world.sim_config(*self.frame_shape)

    @property
    def frame_shape(self) -> tuple[int, int]:
        """(H, W) of decoded frames."""
        if not hasattr(self, "_frame_shape"):
            c, s = self.cfg.channels, self.cfg.sample_size
            self._frame_shape = tuple(self.decode(torch.zeros(1, 1, c, s, s)).shape[:2])
        return self._frame_shape

    def restart_from_buffer(self):
        """Hard cut back to the current clip's history; the noise seed restarts too."""
        if self.clip is None:
            raise RuntimeError("no clip loaded; call load_clip() first")
        latents, mouse, buttons = self.clip.history(self.window)
        return self.hard_cut(latents / self.vae_scale, mouse, buttons)

    def hard_cut(self, history: torch.Tensor | None = None, mouse=None, buttons=None, *, images=None, clip=None,
                 world_seed: int | None = None, reseed: bool = True) -> int:
        """Start a new cache epoch from a new history and return the epoch.

        The history is one of: ``history``, model-space latents [n, c, h, w] (latents /
        vae_scale); ``images``, uint8 RGB frames [n, H, W, 3] encoded with the VAE (n <= window);
        ``clip`` (as ``load_clip``); ``world_seed``, a fresh simulator level (as ``load_world``).
        ``mouse`` [n, 2] and ``buttons`` [n, 11] default to no input. Every index restarts:
        positions, offsets, frame count; ``reseed`` restarts the noise generator at the
        settings' seed (so a cut to the same history replays the same frames).
        """
        given = [x is not None for x in (history, images, clip, world_seed)]
        if sum(given) != 1:
            raise ValueError("hard_cut needs exactly one of history= (latents), images= (uint8 frames), clip= "
                             "or world_seed=")
        if clip is not None:
            self.load_clip(clip)
            return self.cache_epoch
        if world_seed is not None:
            self.load_world(world_seed)
            return self.cache_epoch
        if images is not None:
            if self.decoder is None:
                raise RuntimeError("hard_cut(images=...) needs the autoencoder (no decoder loaded)")
            history = self.decoder.encode_uint8(images) / self.vae_scale
        n = history.shape[0]
        mouse = torch.zeros(n, 2) if mouse is None else torch.as_tensor(mouse, dtype=torch.float32)
        buttons = torch.zeros(n, 11) if buttons is None else torch.as_tensor(buttons, dtype=torch.float32)
        self._check_history(history, mouse, buttons)
        if reseed:
            self.generator.manual_seed(self.settings.seed)
        self._cut(self._noised_history(history), mouse, buttons, clean=history)
        return self.cache_epoch

    def prefill(self, history: torch.Tensor, mouse: torch.Tensor, buttons: torch.Tensor, noised: bool = False):
        """Hard cut to ``history`` [n, c, h, w] in model space without reseeding the noise.

        ``noised``: the history is already the noised model input (used by parity tests)."""
        self._check_history(history, mouse, buttons)
        x = history.float() if noised else self._noised_history(history)
        self._cut(x, mouse.float(), buttons.float(), clean=None if noised else history)

    def _check_history(self, history, mouse, buttons):
        n = history.shape[0]
        c, s = self.cfg.channels, self.cfg.sample_size
        if (history.ndim != 4 or not 1 <= n <= self.window or tuple(history.shape[1:]) != (c, s, s)
                or tuple(mouse.shape) != (n, 2) or tuple(buttons.shape) != (n, 11)):
            raise ValueError(f"history {tuple(history.shape)}, mouse {tuple(mouse.shape)}, buttons "
                             f"{tuple(buttons.shape)}; expected [n <= {self.window}, {c}, {s}, {s}], [n, 2], [n, 11]")

    def _cut(self, noised, mouse, buttons, clean=None):
        self._anchor.clear()
        if clean is not None:
            self._anchor.extend(zip(clean.float().cpu(), mouse.cpu(), buttons.cpu()))
        self.gt_step = 0
        self._run(self.lifecycle.cut(noised.float().cpu(), mouse.float().cpu(), buttons.float().cpu()))
        if self.verbose and self.cache_epoch > 1:  # the first history is part of start-up
            print(f"[owl] hard cut: cache epoch {self.cache_epoch}, {noised.shape[0]} history frames", flush=True)

    # -- recompute ---------------------------------------------------------------------------------
    def anchor(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last ``window`` committed frames (model-space latents, mouse, buttons) a recompute
        rebuilds the cache from ("latent" anchor; "decoded" re-encodes their decoded frames)."""
        if not self._anchor:
            raise RuntimeError("no committed frames to anchor a recompute (the history was given pre-noised)")
        lat, m, b = (torch.stack(t) for t in zip(*self._anchor))
        if self.settings.kv_recompute_anchor == "decoded":
            frames = torch.stack([self.decode(x[None, None]) for x in lat])
            lat = self.decoder.encode_uint8(frames) / self.vae_scale
        return lat, m, b

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

    def _velocity(self, x, t, m, b, write: bool, bias: float):
        self.lifecycle.model_calls += 1
        if self.cache is not None:
            if write:
                self.cache.enable_cache_updates()
            try:
                return self.core(x, t, m, b, kv_cache=self.cache, attn_bias=bias)
            finally:
                self.cache.disable_cache_updates()
        r = self._nocache
        cat = lambda key, new: torch.cat([r[key], new], dim=1)  # noqa: E731
        xs, ts, ms, bs = cat("x", x), cat("t", t), cat("mouse", m), cat("buttons", b)
        # Every frame attends as it did when the cache took it: the history under the frame mask
        # (the prefill), later frames as decoded, each under the soft-forgetting bias of its time.
        decode_from = max(r["prefill_end"] - r["start"], 0)
        biases = (*r["bias"], *(float(bias),) * x.shape[1])
        v = self.core(xs, ts, ms, bs, frame_offset=r["start"], window_cap=self.window,
                      attn_bias=biases if any(biases) else 0.0, decode_from=decode_from)[:, -x.shape[1]:]
        if write:
            drop = max(xs.shape[1] - self._nocache_frames, 0)
            self._nocache = {"x": xs[:, drop:], "t": ts[:, drop:], "mouse": ms[:, drop:], "buttons": bs[:, drop:],
                             "start": r["start"] + drop, "prefill_end": r["prefill_end"], "bias": biases[drop:]}
        return v

    def _reset_cache(self):
        if self.settings.kv_cache == "none":
            c, s = self.cfg.channels, self.cfg.sample_size
            empty = lambda *shape: self._dev(torch.zeros(1, 0, *shape))  # noqa: E731
            self._nocache = {"x": empty(c, s, s), "t": empty(), "mouse": empty(2), "buttons": empty(11), "start": 0,
                             "prefill_end": 0, "bias": ()}
        elif self.cache is None:
            self.cache = build_cache(self.cache_cfg, self.settings, self.window, plans=self.kv_plan)
            if self.profiler and isinstance(self.cache, QuantizedStaticCache):
                self.profiler.instrument(self.cache, "_encode", "quant")
                self.profiler.instrument(self.cache, "_decode", "dequant")
                self.profiler.instrument(self.cache, "_fused_ring_step", "ring_step")  # OWL_COMPILE=1: both in one call
        else:
            self.cache.reset(1)

    def _run(self, plan: StepPlan | None):
        """Execute one step (rank 0 or single process: ``plan``; TP followers: None, received).
        Returns (plan, latent or None)."""
        if self.tp is None:
            return plan, self._step(plan)
        try:
            if self.fault == "envelope" and plan is None and self.lifecycle.call_id == 2:
                self.lifecycle.call_id += 1  # test-only: this rank lost track of one step
            plan = self.tp.exchange(plan, self.lifecycle, self._step_error)
            self._step_error = None
            x = self._step(plan)
            if plan.event == "stop" or self.lifecycle.call_id % self.tp.check_every == 0:
                names = [*Lifecycle.SCALAR_NAMES, *(f"offset{i}" for i in range(self.cfg.n_layers))]
                offsets = [self.cache.get_offset(i) if self.cache is not None else 0 for i in range(self.cfg.n_layers)]
                agreed = self.tp.check_scalars(names, [*self.lifecycle.scalars(), *offsets])
                if plan.event == "stop" and self.verbose:
                    print(f"[owl] tensor parallel: {self.tp.world} ranks agree at stop: {agreed}", flush=True)
            return plan, x
        except TPError:
            raise
        except Exception as exc:  # noqa: BLE001 - a collective broke: a peer died or timed out
            if is_collective_error(exc):
                raise self.tp.explain(exc) from exc
            raise

    def _step(self, plan: StepPlan) -> torch.Tensor | None:
        if plan.event == "stop":
            self.lifecycle.advance(plan)
            return None
        before = self.lifecycle.model_calls
        if self.fault == "raise" and plan.generates and self.lifecycle.frame_index == 3:
            raise RuntimeError("injected fault (--tp-fault raise) before frame 3's first model call")
        x = self._execute(plan)
        if self.fault == "calls" and plan.generates and self.lifecycle.frame_index == 2:
            self.lifecycle.model_calls += 1  # test-only: a stray model call on this rank
        made = self.lifecycle.model_calls - before
        self.lifecycle.advance(plan)
        if made != plan.expected_calls:
            msg = f"made {made} model calls in step {plan.summary()}; the plan expected {plan.expected_calls}"
            if self.tp is None:
                raise LifecycleError(msg)
            self._step_error = msg  # every rank fails together at the next step's vote
        return x

    @torch.no_grad()
    def _execute(self, plan: StepPlan) -> torch.Tensor | None:
        tf = self.model.core.transformer
        if plan.history is not None:
            n = plan.history.shape[0]
            if plan.reset:
                self._reset_cache()
                if self.profiler and plan.event == "cut":
                    self.profiler.start()
                if self._nocache is not None:
                    self._nocache["prefill_end"] = n
            x, t = self._dev(plan.history[None]), self._dev(torch.full((1, n), self.alpha))
            m, b = self._dev(plan.history_mouse[None]), self._dev(plan.history_buttons[None])
            # A new history fills the cache under the frame mask (the original's prefill); an
            # observed frame enters it as a generated frame would, decoding.
            if plan.reset:
                tf.disable_decoding()
            self._velocity(x, t, m, b, write=True, bias=plan.bias)
            tf.enable_decoding()
            if self.profiler:
                if plan.event == "cut":
                    self.profiler.prefill(self.kv_bytes)
                elif plan.event == "recompute":
                    self.profiler.mark("recompute")
        if not plan.generates:
            return None
        m, b = self._dev(plan.mouse.view(1, 1, 2)), self._dev(plan.buttons.view(1, 1, 11))
        x = self._dev(plan.noise)
        sched = self.schedule
        for i in range(len(sched) - 1):
            t = self._dev(torch.full((1, 1), sched[i]))
            v = self._velocity(x, t, m, b, write=plan.commit and i == len(sched) - 2, bias=plan.bias)
            x = x - (sched[i] - sched[i + 1]) * v
            self.last_velocity = v  # the last step's prediction (A/B runs compare it)
            if self.profiler:
                self.profiler.mark(f"step{i + 1}")
        if plan.commit and (self.tp is None or self.tp.is_leader):
            self._anchor.append((x[0, 0].float().cpu(), plan.mouse.float().cpu(), plan.buttons.float().cpu()))
        return x

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
        clean = latent.reshape(1, *latent.shape[-3:]).float().cpu()
        plan = self.lifecycle.observe(self._noised_history(clean), m[None], b[None])
        self._run(plan)
        self._anchor.append((clean[0], m, b))

    @torch.no_grad()
    def generate(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True) -> torch.Tensor:
        """One frame in model space: latent [1, 1, c, h, w] (not yet multiplied by vae_scale).

        ``commit=False`` leaves the history untouched (for teacher forcing with ``observe``).
        When a recompute is due (OWL_KV_RECOMPUTE_EVERY) this step first rebuilds the cache
        from the anchor, with positions from zero."""
        if self.lifecycle.phase is Phase.EMPTY:
            raise RuntimeError("pipeline has no history; call load_clip(), hard_cut() or prefill() first")
        mouse, buttons = self.last_controls = self.next_controls(mouse, buttons)
        anchor = None
        if commit and self.lifecycle.recompute_due and self._anchor:
            lat, am, ab = self.anchor()
            anchor = (self._noised_history(lat), am, ab)  # anchor noise is drawn before the frame's
        if self.ground_truth:
            self.gt_step += 1
        c, s = self.cfg.channels, self.cfg.sample_size
        if noise is None:
            noise = torch.randn((1, 1, c, s, s), generator=self.generator)
        plan = self.lifecycle.frame(mouse.float(), buttons.float(), noise.float().cpu(), commit, anchor)
        _, x = self._run(plan)
        if self.verbose and not self._guard_reported and hasattr(self.cache, "guard_report"):
            report = self.cache.guard_report()
            if report:
                print(report, flush=True)
                self._guard_reported = True
        return x

    # -- tensor parallel -----------------------------------------------------------------------------
    def follow(self) -> int:
        """TP ranks other than 0: execute rank 0's steps until it stops; returns frames made."""
        while True:
            plan, _ = self._run(None)
            if plan.event == "stop":
                return self.lifecycle.frame_index

    def close(self):
        """Rank 0 of a TP run: tell the other ranks to stop (after a final vote and check)."""
        if self.tp is not None and self.tp.is_leader and self.lifecycle.phase is not Phase.EMPTY:
            self._run(self.lifecycle.stop())

    # -- snapshots ----------------------------------------------------------------------------------
    def _identity(self) -> str:
        """What a snapshot must match: world, model config, window, schedule and settings."""
        volatile = {"seed", "profile_kv", "profile_kv_first", "profile_kv_every", "tp_check_every", "tp_timeout_s",
                    "kv_cache_attention_bias"}  # the generator state and the bias travel in the snapshot
        s = {k: str(v) for k, v in vars(self.settings).items() if k not in volatile}
        text = json.dumps([self.world.name, self.cfg.to_dict(), self.window, list(self.schedule), self.alpha, s],
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def get_state(self) -> dict:
        """A snapshot (copies): cache, offsets, lifecycle (epoch, phase, bias, counters), the
        recompute anchor, the noise generator and the replay position. ``load_state`` on a
        pipeline with the same checkpoint and settings continues with identical frames."""
        if self.tp is not None:
            raise RuntimeError("snapshots of a tensor-parallel pipeline are not supported (each rank holds "
                               "only its heads); snapshot a single-process run")
        tensors = {"rng": self.generator.get_state()}
        meta = {"format": STATE_FORMAT, "identity": self._identity(), "world": self.world.name,
                "lifecycle": self.lifecycle.state(), "gt_step": self.gt_step, "ground_truth": self.ground_truth,
                "clip": self.clip.name if self.clip is not None else None, "anchor": len(self._anchor)}
        for i, (lat, m, b) in enumerate(self._anchor):
            tensors.update({f"anchor.{i}.latent": lat, f"anchor.{i}.mouse": m, f"anchor.{i}.buttons": b})
        if self.cache is not None:
            cache_tensors, meta["cache"] = self.cache.state_dict()
            tensors.update({f"cache.{k}": v for k, v in cache_tensors.items()})
        if self._nocache is not None:
            tensors.update({f"nocache.{k}": v for k, v in self._nocache.items() if isinstance(v, torch.Tensor)})
            meta["nocache"] = {k: v for k, v in self._nocache.items() if not isinstance(v, torch.Tensor)}
        return {"tensors": {k: v.detach().clone() for k, v in tensors.items()}, "meta": meta}

    @torch.no_grad()
    def load_state(self, state: dict | str | Path):
        """Restore a snapshot from ``get_state()`` or a file written by ``save_state``."""
        if not isinstance(state, dict):
            state = read_state(state)
        tensors, meta = state["tensors"], state["meta"]
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"snapshot format {meta.get('format')!r} is not {STATE_FORMAT!r}")
        if meta["identity"] != self._identity():
            raise ValueError(f"snapshot was taken from world {meta['world']!r} with other model or settings "
                             f"(identity {meta['identity']}, this pipeline {self._identity()}); load it into a "
                             "pipeline built from the same checkpoint and OWL_* settings")
        if "cache" in meta:
            self._reset_cache()
            self.cache.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("cache.")},
                                       meta["cache"])
        if "nocache" in meta:
            self._nocache = {k[8:]: self._dev(v) for k, v in tensors.items() if k.startswith("nocache.")}
            self._nocache.update(meta["nocache"], bias=tuple(meta["nocache"]["bias"]))
        self._anchor.clear()
        self._anchor.extend((tensors[f"anchor.{i}.latent"].clone(), tensors[f"anchor.{i}.mouse"].clone(),
                             tensors[f"anchor.{i}.buttons"].clone()) for i in range(meta["anchor"]))
        self.lifecycle.load_state(meta["lifecycle"])
        self.generator.set_state(tensors["rng"].clone())
        self.gt_step, self.ground_truth = meta["gt_step"], meta["ground_truth"]

    def save_state(self, path: str | Path) -> Path:
        """Write ``get_state()`` to a safetensors file (atomically: a crash leaves no partial file)."""
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot save the snapshot to {str(path)!r}: folder {str(path.parent)!r} "
                                    "does not exist")
        state = self.get_state()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file({k: v.contiguous() for k, v in state["tensors"].items()}, str(tmp),
                      metadata={"owl_state": json.dumps(state["meta"])})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

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
            self.profiler.frame(self.kv_bytes, self.cache.scale_nbytes() if self.cache is not None else 0,
                                epoch=self.cache_epoch, event=self.lifecycle.event)
        return frame, time.perf_counter() - start


def read_state(path: str | Path) -> dict:
    """A snapshot file written by ``CausvidPipeline.save_state``."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"snapshot {str(path)!r} does not exist")
    with safe_open(str(path), "pt") as f:
        meta = (f.metadata() or {}).get("owl_state")
    if meta is None:
        raise ValueError(f"{str(path)!r} is a safetensors file but not a pipeline snapshot (no owl_state metadata)")
    return {"tensors": load_file(str(path)), "meta": json.loads(meta)}
