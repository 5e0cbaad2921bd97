"""CausVid two-step streaming pipeline (docs/architecture.md, The pipeline).

Prefill the window with the noised history at t = alpha (cache writes on); then each frame:
z ~ N(0, I) -> v1 = model(z, 1) (writes off) -> x = z - 0.75 v1 -> v2 = model(x, 0.25)
(writes on: this frame enters the window) -> x0 = x - 0.25 v2 -> decode(x0 * vae_scale).
The schedule generalises to any t_0 = 1 > ... > t_K = 0; the cache is written at the last step.

Every step is a ``StepPlan`` of the cache lifecycle (lifecycle.py): hard cuts, recomputes,
observed frames and generated frames all run through ``execute`` (a batch of sessions through
``plan_frame``, ``write_history`` and ``finish_frame`` around its batched call, sessions.py).
The model calls themselves are the runner's (runner.py). Around it, collaborators:
tensor_parallel.py runs the steps in lockstep on every rank, nocache.py is the cache-free
baseline, snapshot.py saves and restores the state, and profiler.py times the sections of a frame.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..cache import describe_plan
from ..clips import Clip
from ..config import WorldConfig, check_schedule, load_world
from ..controls import N_BUTTONS, as_controls, no_controls, to_uint8
from ..loading import SHIPPED_WORLD, build_model, load_weights, read_weights
from ..parallel import ParallelContext
from ..sampler import euler
from ..settings import KVSettings, Settings
from ..vae import FrameDecoder, load_decoder
from . import snapshot
from .anchor import RecomputeAnchor
from .lifecycle import Lifecycle, LifecycleError, Phase, StepPlan
from .nocache import NoCacheHistory
from .profiler import KVProfiler, NoProfiler
from .replay import ClipReplay
from .runner import ModelRunner
from .tensor_parallel import TensorParallelSteps


class CausvidPipeline:
    def __init__(self, model, decoder: FrameDecoder | None, world: WorldConfig, settings: Settings | None = None,
                 ground_truth: bool = False, verbose: bool = True, tp: ParallelContext | None = None,
                 weights: str | None = None, runner: ModelRunner | None = None, cache=None):
        """``settings``: typed settings (default: the config's ``inference:`` section alone);
        ``tp``: this rank's tensor-parallel context; ``weights``: which weights were loaded;
        ``runner``: the model, decoder and model call shared with other sessions (default: its
        own); ``cache``: this session's cache (default: made at the first history)."""
        self.world, self.cfg, self.weights = world, world.model, weights
        self.settings = s = settings or Settings.from_config(world.inference)
        self.window, self.alpha, self.vae_scale = world.pipeline.window_frames, world.pipeline.history_alpha, world.vae_scale
        self.lifecycle = Lifecycle(len(world.pipeline.schedule) - 1, s.kv_recompute_every, s.kv_cache_attention_bias)
        self.schedule = world.pipeline.schedule
        self.n_params = sum(p.numel() for p in model.parameters())  # the whole model, before any sharding
        self.verbose = verbose and (tp is None or tp.is_leader)
        self.log = lambda text: print(text, flush=True)  # where messages go (a progress bar may take them)
        # Under tensor parallelism each rank holds some heads; its cache sees only those.
        self.tp = TensorParallelSteps(self, tp, model) if tp is not None else None
        self.cache_cfg = tp.local_config(self.cfg) if tp is not None else self.cfg
        self.runner = runner or ModelRunner(model, decoder, world, s, self.cache_cfg, tp)
        self.model, self.core, self.decoder = self.runner.model, self.runner.core, self.runner.decoder
        self.device, self.kv_plan = self.runner.device, self.runner.kv_plan
        # Noise is drawn where the model runs (no host-to-device copy in a frame); under tensor
        # parallelism rank 0 draws it on the host, as the step plan it broadcasts is pickled.
        self.noise_device = self.device if tp is None else torch.device("cpu")
        self.generator = torch.Generator(self.noise_device).manual_seed(s.seed)
        profile = s.profile_kv and (tp is None or tp.is_leader)  # rank 0's comm time includes waiting
        self.profiler = KVProfiler.attach(self, tp) if profile else NoProfiler()
        self.cache = cache  # built at the first history unless given (a row of a batch's ring)
        self.nocache = NoCacheHistory(self.cfg.n_layers, self.window) if s.kv_cache == "none" else None
        self.recompute_anchor = RecomputeAnchor(self.window)
        self.replay = ClipReplay(world, ground_truth)
        self.last_velocity = None  # the last step's prediction (A/B runs compare it)
        self.last_controls = None  # (mouse, buttons) the last frame used: the player's or the clip's (GT)
        self._guard_reported = False
        if self.verbose:
            self.log(startup_text(self))

    @classmethod
    def from_checkpoint(cls, checkpoint=None, ckpt_path=None, **options) -> "CausvidPipeline":
        """The pipeline of a checkpoint folder, config file or loaded config (see ``load_pipeline``)."""
        return load_pipeline(checkpoint, ckpt_path, cls=cls, **options)

    @property
    def schedule(self) -> tuple[float, ...]:
        return self._schedule

    @schedule.setter
    def schedule(self, value):
        """The sampler's t_0 = 1 > ... > t_K = 0 (evaluation swaps in a many-step Euler one)."""
        self._schedule = check_schedule(value)
        self.lifecycle.n_steps = len(self._schedule) - 1

    cache_epoch = property(lambda self: self.lifecycle.epoch, doc="+1 at every hard cut (a new history); 0 before")
    frame_index = property(lambda self: self.lifecycle.frame_index, doc="frames added since the last hard cut")
    kv_cache_attention_bias = property(lambda self: self.lifecycle.bias, lambda self, v: self.lifecycle.set_bias(v),
                                       doc="soft forgetting, live: the logit bias of cached history keys")
    kv_bytes = property(lambda self: self.cache.nbytes() if self.cache is not None else 0)
    clip = property(lambda self: self.replay.clip, doc="the clip the history came from (None: none)")

    @property
    def ground_truth(self) -> bool:
        """Frames take the clip's recorded actions (ground-truth replay) instead of the player's."""
        return self.replay.on

    @ground_truth.setter
    def ground_truth(self, on: bool):
        """Turned on, the clip's recorded actions replay from their start."""
        self.replay.on = bool(on)
        if self.replay.on:
            self.replay.step = 0

    @property
    def frame_shape(self) -> tuple[int, int]:
        """(H, W) of decoded frames."""
        if not hasattr(self, "_frame_shape"):
            c, s = self.cfg.channels, self.cfg.sample_size
            self._frame_shape = tuple(self.decode(torch.zeros(1, 1, c, s, s)).shape[:2])
        return self._frame_shape

    # -- history ---------------------------------------------------------------------------------
    def load_clip(self, clip=0) -> Clip:
        """Start from a clip: an index into the world's clips, a path, or a ``Clip``."""
        self.replay.load(clip)
        self.restart_from_buffer()
        return self.clip

    def restart_from_buffer(self) -> int:
        """Hard cut back to the current clip's history; the noise seed restarts too."""
        if self.clip is None:
            raise RuntimeError("no clip loaded; call load_clip() first")
        latents, mouse, buttons = self.clip.history(self.window)
        return self.hard_cut(latents / self.vae_scale, mouse, buttons)

    def hard_cut(self, history: torch.Tensor | None = None, mouse=None, buttons=None, *, images=None, clip=None,
                 reseed: bool = True) -> int:
        """Start a new cache epoch from a new history; returns the epoch. The history is one of
        ``history``, model-space latents [n, c, h, w] (latents / vae_scale); ``images``, uint8 RGB
        frames [n, H, W, 3] that the VAE encodes; ``clip`` (as ``load_clip``). ``mouse`` [n, 2]
        and ``buttons`` [n, 11] default to no input. Positions, offsets and the frame count
        restart; ``reseed`` restarts the noise at the settings' seed (same cut, same frames)."""
        if sum(x is not None for x in (history, images, clip)) != 1:
            raise ValueError("hard_cut needs exactly one of history= (latents), images= (uint8 frames) or clip=")
        if clip is not None:
            self.load_clip(clip)
            return self.cache_epoch
        if images is not None:
            if self.decoder is None:
                raise RuntimeError("hard_cut(images=...) needs the autoencoder (no decoder loaded)")
            history = self.decoder.encode_uint8(images) / self.vae_scale
        none_m, none_b = no_controls(history.shape[0])
        mouse = none_m if mouse is None else torch.as_tensor(mouse, dtype=torch.float32)
        buttons = none_b if buttons is None else torch.as_tensor(buttons, dtype=torch.float32)
        self._check_history(history, mouse, buttons)  # before the reseed: a refused cut changes nothing
        if reseed:
            self.generator.manual_seed(self.settings.seed)
        self.prefill(history, mouse, buttons)
        return self.cache_epoch

    def prefill(self, history: torch.Tensor, mouse: torch.Tensor, buttons: torch.Tensor, noised: bool = False):
        """Hard cut to ``history`` [n, c, h, w] in model space without reseeding the noise;
        ``noised``: the history is already the noised model input (parity tests)."""
        self._check_history(history, mouse, buttons)
        self.recompute_anchor.restart(*(() if noised else (history, mouse, buttons)))
        x = history.float().to(self.noise_device) if noised else self._noised_history(history)
        self.replay.step = 0
        if self.verbose and self.cache_epoch == 0:  # the first history is start-up's last step
            compiling = ("; OWL_COMPILE=1: the frame call compiles at the first frame (up to a minute on a CPU)"
                         if self.settings.compile else "")
            self.log(f"[owl] warm-up: prefilling {history.shape[0]} history frames{compiling} ...")
        self._run(self.lifecycle.cut(x, mouse.float().cpu(), buttons.float().cpu()))
        if self.verbose and self.cache_epoch > 1:  # the first history is part of start-up
            self.log(f"[owl] hard cut: cache epoch {self.cache_epoch}, {history.shape[0]} history frames")

    def _check_history(self, history, mouse, buttons):
        n, c, s = history.shape[0], self.cfg.channels, self.cfg.sample_size
        if (history.ndim != 4 or not 1 <= n <= self.window or tuple(history.shape[1:]) != (c, s, s)
                or tuple(mouse.shape) != (n, 2) or tuple(buttons.shape) != (n, N_BUTTONS)):
            raise ValueError(f"history {tuple(history.shape)}, mouse {tuple(mouse.shape)}, buttons "
                             f"{tuple(buttons.shape)}; expected [n <= {self.window}, {c}, {s}, {s}], [n, 2], [n, 11]")

    def anchor(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a recompute rebuilds the cache from: the anchor's latents, or with
        kv_recompute_anchor "decoded" their decoded frames re-encoded (what the player saw)."""
        lat, m, b = self.recompute_anchor.stacked()
        if self.settings.kv_recompute_anchor == "decoded":
            lat = self.decoder.encode_uint8(torch.stack([self.decode(x[None, None]) for x in lat])) / self.vae_scale
        return lat, m, b

    def noise(self, shape=None) -> torch.Tensor:
        """Standard normal noise from the pipeline's generator, on its device: one frame's
        [1, 1, c, h, w] by default."""
        if shape is None:
            shape = (1, 1, self.cfg.channels, self.cfg.sample_size, self.cfg.sample_size)
        return torch.randn(shape, generator=self.generator, device=self.noise_device)

    def _noised_history(self, x: torch.Tensor) -> torch.Tensor:
        """History frames enter the cache noised at alpha: (1 - alpha) x + alpha eps."""
        x = x.float().to(self.noise_device)
        return (1 - self.alpha) * x + self.alpha * self.noise(x.shape)

    # -- steps -----------------------------------------------------------------------------------
    def _run(self, plan: StepPlan | None) -> tuple[StepPlan, torch.Tensor | None]:
        """Execute one step: ``plan``, or under tensor parallelism rank 0's (None on the others)."""
        return self.tp.run(plan) if self.tp is not None else (plan, self.execute(plan))

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Execute a plan and check it made the model calls it planned (tensor-parallel ranks
        execute rank 0's plans through this)."""
        before = self.lifecycle.model_calls
        x = self._execute(plan) if plan.event != "stop" else None
        made = self.lifecycle.model_calls - before
        self.lifecycle.advance(plan)
        if made != plan.expected_calls:
            msg = f"made {made} model calls in step {plan.summary()}; the plan expected {plan.expected_calls}"
            if self.tp is None:
                raise LifecycleError(msg)
            self.tp.step_error = msg  # every rank fails together at the next step's vote
        return x

    @torch.no_grad()
    def _execute(self, plan: StepPlan) -> torch.Tensor | None:
        self.write_history(plan)
        if not plan.generates:
            return None
        dev = lambda t: t.to(self.device, self.settings.dtype)  # noqa: E731
        m, b = dev(plan.mouse.view(1, 1, 2)), dev(plan.buttons.view(1, 1, N_BUTTONS))
        x = self.denoise(dev(plan.noise), m, b, plan.bias, plan.commit)
        if plan.commit and (self.tp is None or self.tp.is_leader):
            self.recompute_anchor.add(x[0, 0], plan.mouse, plan.buttons)
        return x

    @torch.no_grad()
    def write_history(self, plan: StepPlan) -> None:
        """The frames ``plan`` writes before its frame, if any: a new history (hard cut,
        recompute) or an observed frame."""
        if plan.history is None:
            return
        dev = lambda t: t.to(self.device, self.settings.dtype)  # noqa: E731
        if plan.reset:
            self._reset_cache(plan.history.shape[0])
            self.profiler.cut_started(plan.event)
        t = torch.full((1, plan.history.shape[0]), self.alpha)
        # A new history fills the cache under the frame mask (the original's prefill); an
        # observed frame enters it as a generated frame would, decoding.
        if plan.reset:
            self.core.transformer.disable_decoding()
        self._velocity(dev(plan.history[None]), dev(t), dev(plan.history_mouse[None]),
                       dev(plan.history_buttons[None]), write=True, bias=plan.bias)
        self.core.transformer.enable_decoding()
        self.profiler.history_done(plan.event, self.kv_bytes)

    def denoise(self, x, mouse, buttons, bias: float, commit: bool) -> torch.Tensor:
        """A frame from noise ``x`` [1, 1, c, h, w] down the schedule; the last step writes the cache."""
        last = len(self.schedule) - 2

        def velocity(x, t, i):
            v = self.last_velocity = self._velocity(x, torch.full((1, 1), t, device=self.device, dtype=x.dtype),
                                                    mouse, buttons, write=commit and i == last, bias=bias)
            self.profiler.mark(f"step{i + 1}")
            return v

        return euler(velocity, x, self.schedule)

    def _velocity(self, x, t, m, b, write: bool, bias: float) -> torch.Tensor:
        self.lifecycle.model_calls += 1
        if self.nocache is not None:
            return self.nocache.velocity(self.core, x, t, m, b, write, bias)
        return self.runner.call(x, t, m, b, self.cache, bias, write)

    def _reset_cache(self, history_frames: int):
        if self.nocache is not None:
            self.nocache.reset(self.cfg, self.device, self.settings.dtype, prefill_end=history_frames)
        elif self.cache is None:
            self.cache = self.runner.new_cache()
            self.profiler.watch_cache(self.cache)
        else:
            self.cache.reset()

    # -- frames ------------------------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, latent: torch.Tensor, mouse, buttons):
        """Teacher forcing: append a real frame (model space [1, 1, c, h, w]) to the history,
        noised at alpha like the prefill, in place of a generated one."""
        m, b = as_controls(mouse, buttons)
        clean = latent.reshape(1, *latent.shape[-3:]).float().cpu()
        self._run(self.lifecycle.observe(self._noised_history(clean), m[None], b[None]))
        self.recompute_anchor.add(clean[0], m, b)

    @torch.no_grad()
    def generate(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True) -> torch.Tensor:
        """One frame in model space: latent [1, 1, c, h, w] (not yet multiplied by vae_scale).
        ``commit=False`` leaves the history untouched (teacher forcing with ``observe``). When a
        recompute is due (kv_recompute_every) the step first rebuilds the cache from the anchor."""
        _, x = self._run(self.plan_frame(mouse, buttons, noise, commit))
        report = self.verbose and not self._guard_reported and getattr(self.cache, "guard_report", lambda: None)()
        if report:  # the ring guard's checksum window is over
            self.log(report)
            self._guard_reported = True
        return x

    def plan_frame(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True) -> StepPlan:
        """The step that makes this session's next frame (``generate`` runs it; a batch of
        sessions runs many in one call): the controls (the clip's in ground-truth mode), a
        recompute's anchor if one is due, and the noise, drawn anchor first."""
        if self.lifecycle.phase is Phase.EMPTY:
            raise RuntimeError("pipeline has no history; call load_clip(), hard_cut() or prefill() first")
        mouse, buttons = self.last_controls = self.replay.controls(mouse, buttons)
        anchor = None
        if commit and self.lifecycle.recompute_due and self.recompute_anchor:
            lat, am, ab = self.anchor()
            anchor = (self._noised_history(lat), am, ab)  # anchor noise is drawn before the frame's
        noise = self.noise() if noise is None else noise.float().to(self.noise_device)
        return self.lifecycle.frame(mouse.float(), buttons.float(), noise, commit, anchor)

    def finish_frame(self, plan: StepPlan, latent: torch.Tensor, denoise_calls: int) -> None:
        """After a batch made ``plan``'s frame ``latent`` [1, 1, c, h, w] in ``denoise_calls`` model
        calls (``write_history`` counted its own): the anchor and the lifecycle follow, as after
        ``generate``, which fails fast if the calls differ from the plan's."""
        self.lifecycle.model_calls += denoise_calls
        if plan.commit:
            self.recompute_anchor.add(latent[0, 0], plan.mouse, plan.buttons)
        self.lifecycle.advance(plan)

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise RuntimeError("this pipeline was built without a decoder")
        return to_uint8(self.decoder.decode(latent[:, 0].float() * self.vae_scale)[0])

    @torch.no_grad()
    def __call__(self, mouse, buttons) -> tuple[torch.Tensor, float]:
        """mouse [2], buttons [11] (owl_wms/controls.py) -> (uint8 RGB frame [H, W, 3], wall
        seconds for denoising + decoding)."""
        start = time.perf_counter()
        self.profiler.start()
        frame = self.decode(self.generate(mouse, buttons))
        self.profiler.frame_done(self)
        return frame, time.perf_counter() - start

    # -- tensor parallel and snapshots (tensor_parallel.py, snapshot.py) ---------------------------
    def close(self):
        """Rank 0 of a TP run: tell the other ranks to stop (after a final vote and check)."""
        if self.tp is not None and self.tp.is_leader and self.lifecycle.phase is not Phase.EMPTY:
            self._run(self.lifecycle.stop())

    get_state, load_state, save_state = snapshot.get_state, snapshot.load_state, snapshot.save_state


def load_parts(checkpoint=None, ckpt_path=None, weights: str | None = None, decoder: bool = True):
    """(world, model, decoder or None, a description of the weights) of a checkpoint folder, a
    config file or a config already read by ``load_world`` (default: the shipped world)."""
    world = checkpoint if isinstance(checkpoint, WorldConfig) else load_world(
        SHIPPED_WORLD if checkpoint is None else checkpoint)
    if ckpt_path is None and world.path is None:
        raise ValueError("this config was not read from a file, so no weights lie beside it; pass ckpt_path")
    ckpt_path = Path(ckpt_path) if ckpt_path is not None else world.path.parent / "model.safetensors"
    loaded = read_weights(ckpt_path, weights)
    model = load_weights(build_model(world.model), loaded.tensors, str(ckpt_path))
    return world, model, load_decoder(world) if decoder else None, loaded.describe()


def load_pipeline(checkpoint=None, ckpt_path=None, settings: Settings | None = None, clip=0, ground_truth: bool = False,
                  verbose: bool = True, tp: ParallelContext | None = None, weights: str | None = None,
                  cls=CausvidPipeline) -> CausvidPipeline:
    """``checkpoint``: a checkpoint folder (with config.yaml), a config file, or a config already
    read by ``load_world`` (default: the shipped world). ``weights``: "ema" or "online" of a
    trainer checkpoint holding both (default: EMA where present). Under tensor parallelism only
    rank 0 loads the decoder."""
    world, model, decoder, described = load_parts(checkpoint, ckpt_path, weights, tp is None or tp.is_leader)
    pipe = cls(model, decoder, world, settings, ground_truth=ground_truth, verbose=verbose, tp=tp, weights=described)
    if clip is not None and (tp is None or tp.is_leader):
        pipe.load_clip(clip)
    return pipe


def startup_text(pipe) -> str:
    """The start-up line: world, model, sampler and settings (and the TP split and cache plan)."""
    label = "" if pipe.world.trained else " UNTRAINED (random weights: frames show noise)"
    local = sum(p.numel() for p in pipe.model.parameters())
    per_rank = f" (rank 0 holds {local / 1e6:.1f}M)" if pipe.tp is not None else ""
    weights = f" weights={pipe.weights}" if pipe.weights else ""
    text = (f"[owl] world={pipe.world.name}{label} params={pipe.n_params / 1e6:.1f}M{per_rank}{weights} "
            f"rope={pipe.cfg.rope_impl} window={pipe.window} alpha={pipe.alpha} "
            f"schedule={'>'.join(f'{t:g}' for t in pipe.schedule)} | {pipe.settings.describe()}")
    if pipe.tp is not None:
        text += "\n" + pipe.tp.describe()
    if pipe.kv_plan is not None and pipe.settings.kv != KVSettings():
        text += f"\n[owl] kv plan: {describe_plan(pipe.kv_plan)}"
    s = pipe.settings
    if pipe.runner.describe():
        text += "\n" + pipe.runner.describe()
    if s.compile and s.device == "cpu" and "flex" in (s.attn_backend, s.attn_backend_decode):
        text += ("\n[owl] compile: FlexAttention stays eager on CPU (inductor's CPU lowering fails for these "
                 "shapes); the rest of every block is compiled")
    return text
