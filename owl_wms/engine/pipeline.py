"""One session of the CausVid two-step streaming pipeline (docs/architecture.md, The pipeline).

After a history prefilled at t = alpha, each frame: z ~ N(0, I) -> v1 = model(z, 1) -> x = z - 0.75 v1
-> v2 = model(x, 0.25) (this call writes the cache) -> x0 = x - 0.25 v2 -> decode(x0 * vae_scale).
Every step is a ``StepPlan`` (planner.py), run by ``execute``: its history, its frame, the
bookkeeping; sessions.py runs the same parts for a batch of sessions around one call.
"""
from __future__ import annotations

import time

import torch

from ..clips import Clip
from ..config import WorldConfig
from ..controls import N_BUTTONS, to_uint8
from ..parallel import ParallelContext, digest, fingerprint
from ..settings import Settings
from ..vae import FrameDecoder
from . import snapshot
from .build import load_pipeline, startup_text
from .lifecycle import StepPlan
from .nocache import NoCacheHistory
from .planner import FramePlanner
from .profiler import KVProfiler, NoProfiler
from .runner import ModelRunner
from .stages import FirstStage, Mesh
from .tensor_parallel import TensorParallelSteps


class CausvidPipeline:
    def __init__(self, model, decoder: FrameDecoder | None, world: WorldConfig, settings: Settings | None = None,
                 ground_truth: bool = False, verbose: bool = True, tp: ParallelContext | None = None,
                 weights: str | None = None, runner: ModelRunner | None = None, cache=None,
                 pp: ParallelContext | None = None, stage=None):
        """``tp``: this rank's tensor-parallel context; ``pp``: this rank's place in two pipeline
        stages (rank 0 plans and decodes, the other ranks generate: stages.py; with ``tp`` too, the
        generating ranks split the heads); ``weights``: what was loaded
        (for the start-up line); ``runner``, ``cache``: model calls shared with other sessions, this
        session's cache row; ``stage(pipe)``: this session's ``FirstStage`` on a link that sessions
        share (session_stages.py)."""
        self.world, self.cfg, self.weights = world, world.model, weights
        self.settings = s = settings or Settings.from_config(world.inference)
        self.window, self.alpha, self.vae_scale = world.pipeline.window_frames, world.pipeline.history_alpha, world.vae_scale
        n_params = sum(p.numel() for p in model.parameters())  # the whole model, before any sharding
        self.verbose, self.log = verbose and (tp is None or tp.is_leader) and (pp is None or pp.is_leader), print
        if pp is not None:  # both stages must have been started alike, with the same (unsharded) weights
            pp.agree(digest(s, world, fingerprint(model)))
        self.tp = TensorParallelSteps(self, tp, model) if tp is not None else None  # shards the model
        cache_cfg = tp.local_config(self.cfg) if tp is not None else self.cfg  # a rank's cache: its heads
        self.runner = runner or ModelRunner(model, decoder, world, s, cache_cfg, tp)
        self.device, self.decoder = self.runner.device, self.runner.decoder
        # Noise is drawn where the model runs; under TP rank 0 draws it on the host (plans are pickled).
        self.planner = FramePlanner(world, s, self.device if tp is None else "cpu", ground_truth)
        self.lifecycle, self.noise, self.replay = self.planner.lifecycle, self.planner.noise, self.planner.replay
        self.recompute_anchor = self.planner.recompute_anchor  # the session's state, each part its owner's
        self.cache = cache or (self.runner.new_cache() if s.kv_cache != "none"
                               else NoCacheHistory(self.cfg, self.window, self.device, s.dtype))
        profile = s.profile_kv and (tp is None or tp.is_leader)  # rank 0's comm time includes waiting
        self.profiler = KVProfiler.attach(self, tp) if profile else NoProfiler()
        self.last_velocity = self._guard_said = None  # the last step's prediction (A/B runs); the guard's report
        self.stages = stage(self) if stage is not None else None if pp is None else \
            FirstStage(self, pp) if pp.is_leader else Mesh(self, pp)
        if self.verbose:
            self.log(startup_text(self, n_params))

    @classmethod
    def from_checkpoint(cls, checkpoint=None, ckpt_path=None, **options) -> "CausvidPipeline":
        """The pipeline of a checkpoint folder, config file or loaded config (``build.load_pipeline``)."""
        return load_pipeline(cls, checkpoint, ckpt_path, **options)

    schedule = property(lambda self: self.planner.schedule, lambda self, v: setattr(self.planner, "schedule", v),
                        doc="the sampler's t_0 = 1 > ... > t_K = 0 (evaluation swaps in a many-step Euler one)")
    guidance = property(lambda self: self.planner.guidance, lambda self, v: setattr(self.planner, "guidance", v),
                        doc="the first step's control guidance (PipelineConfig.guidance; 1: none)")
    last_controls = property(lambda self: self.planner.last_controls, doc="(mouse, buttons) the last frame used")
    cache_epoch = property(lambda self: self.lifecycle.epoch, doc="+1 at every hard cut (a new history); 0 before")
    frame_index = property(lambda self: self.lifecycle.frame_index, doc="frames added since the last hard cut")
    kv_cache_attention_bias = property(lambda self: self.lifecycle.bias, lambda self, v: self.lifecycle.set_bias(v),
                                       doc="soft forgetting, live: the logit bias of cached history keys")
    kv_bytes = property(lambda self: self.cache.nbytes())
    clip = property(lambda self: self.replay.clip, doc="the clip the history came from (None: none)")
    frame_shape = property(lambda self: self._decoder().frame_shape(self.cfg.sample_size), doc="(H, W) of frames")
    ground_truth = property(lambda self: self.replay.on, lambda self, on: self.replay.set_on(on),
                            doc="frames take the clip's recorded actions (from their start) instead of the player's")

    def load_clip(self, clip=0) -> Clip:
        """Start from a clip: an index into the world's clips, a path, or a ``Clip``."""
        self.replay.load(clip)
        self.restart_from_buffer()
        return self.clip

    def restart_from_buffer(self) -> int:
        """Hard cut back to the current clip's history; the noise seed restarts too."""
        latents, mouse, buttons = self.replay.history(self.window)
        return self.hard_cut(latents / self.vae_scale, mouse, buttons)

    def hard_cut(self, history: torch.Tensor | None = None, mouse=None, buttons=None, *, images=None, clip=None,
                 reseed: bool = True) -> int:
        """A new cache epoch from one of ``history`` (model-space latents [n, c, h, w]), ``images``
        (uint8 RGB [n, H, W, 3], encoded) or ``clip`` (as ``load_clip``), with ``mouse`` [n, 2] and
        ``buttons`` [n, 11] (default: none); ``reseed``: the noise restarts at the settings' seed."""
        if sum(x is not None for x in (history, images, clip)) != 1:
            raise ValueError("hard_cut needs exactly one of history= (latents), images= (uint8 frames) or clip=")
        if clip is not None:
            self.load_clip(clip)
            return self.cache_epoch
        if images is not None:
            history = self._decoder().encode_uint8(images) / self.vae_scale
        history, mouse, buttons = self.planner.check(history, mouse, buttons)
        if reseed:  # after the check: a refused cut changes nothing
            self.noise.restart()
        self.prefill(history, mouse, buttons)
        return self.cache_epoch

    def prefill(self, history: torch.Tensor, mouse: torch.Tensor, buttons: torch.Tensor, noised: bool = False):
        """A hard cut without reseeding; ``noised``: ``history`` is already the model input (parity tests)."""
        if self.verbose and self.cache_epoch == 0:  # the first history is start-up's last step
            self.log(f"[owl] warm-up: prefilling {history.shape[0]} history frames ...")
        self._run(self.planner.cut(history, mouse, buttons, noised))
        if self.verbose and self.cache_epoch > 1:
            self.log(f"[owl] hard cut: cache epoch {self.cache_epoch}, {history.shape[0]} history frames")

    @torch.no_grad()
    def observe(self, latent: torch.Tensor, mouse, buttons):
        """Teacher forcing: a real frame (model space [1, 1, c, h, w]) joins the history, noised at alpha."""
        self._run(self.planner.observe(latent, mouse, buttons))

    # -- one frame: plan, (history), denoise, finish, decode --------------------------------------
    @torch.no_grad()
    def __call__(self, mouse, buttons) -> tuple[torch.Tensor, float]:
        """mouse [2], buttons [11] -> (uint8 RGB frame [H, W, 3], seconds to denoise and decode)."""
        start = time.perf_counter()
        self.profiler.start()
        frame = self.decode(self.generate(mouse, buttons))
        self.profiler.frame_done(self)
        return frame, time.perf_counter() - start

    @torch.no_grad()
    def generate(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True) -> torch.Tensor:
        """One frame in model space: latent [1, 1, c, h, w] (not yet multiplied by vae_scale).
        ``commit=False`` leaves the history untouched (teacher forcing with ``observe``)."""
        return self._run(self.plan_frame(mouse, buttons, noise, commit))[1]

    def plan_frame(self, mouse, buttons, noise: torch.Tensor | None = None, commit: bool = True) -> StepPlan:
        """The step that makes this session's next frame (planner.py; a recompute may re-encode
        what the player saw)."""
        return self.planner.frame(mouse, buttons, noise, commit,
                                  lambda lat: self._decoder().reencode(lat * self.vae_scale) / self.vae_scale)

    def _run(self, plan: StepPlan) -> tuple[StepPlan, torch.Tensor | None]:
        """Execute ``plan`` here, or in lockstep with every tensor-parallel rank."""
        if self.tp is not None:
            return self.tp.run(plan)
        return self.stages.run(plan) if self.stages is not None else (plan, self.execute(plan))

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run a step: the history it writes, its frame (if it makes one), the bookkeeping."""
        calls, before = self.write_history(plan), self.runner.calls
        if not plan.generates:
            return self.planner.finish(plan, None, calls)
        x = self.runner.denoise(*self.runner.inputs(plan.noise, plan.mouse.view(1, 1, 2), plan.buttons.view(1, 1, N_BUTTONS)),
                                self.cache, self.schedule, plan.bias, plan.commit, self._after_step, self.guidance)
        self.finish_frame(plan, x, calls + self.runner.calls - before)
        return x

    def _after_step(self, i: int, velocity: torch.Tensor) -> None:
        self.last_velocity = velocity
        self.profiler.mark(f"step{i + 1}")

    @torch.no_grad()
    def write_history(self, plan: StepPlan) -> int:
        """The frames ``plan`` writes first: a new history under the frame mask (the original's
        prefill), or an observed frame as a generated one would be. Returns the model calls made."""
        if plan.history is None:
            return 0
        n, before = plan.history.shape[0], self.runner.calls
        if plan.reset:
            self.cache.reset(n) if isinstance(self.cache, NoCacheHistory) else self.cache.reset()
            self.profiler.cut_started(plan.event)
            self.runner.core.transformer.disable_decoding()
        try:
            self.runner.call(*self.runner.inputs(plan.history[None], torch.full((1, n), self.alpha),
                                                 plan.history_mouse[None], plan.history_buttons[None]),
                             self.cache, plan.bias, True)
        finally:
            self.runner.core.transformer.enable_decoding()
        self.profiler.history_done(plan.event, self.kv_bytes)
        return self.runner.calls - before

    def finish_frame(self, plan: StepPlan, latent: torch.Tensor, calls: int) -> None:
        """After ``plan``'s frame ``latent`` was made in ``calls`` model calls (its history's included)."""
        self.planner.finish(plan, latent, calls)
        self._say_guard_report()

    def _say_guard_report(self, final: bool = False) -> None:
        """The ring guard's checksum line once its window is over (``final``: the run ends first)."""
        report = self.verbose and getattr(self.cache, "guard_report", lambda final: None)(final)
        if report and report != self._guard_said:
            self.log(report)
            self._guard_said = report

    def decoder_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """A model-space latent [1, 1, c, h, w] as the decoder takes it: [1, c, h, w], float32, times vae_scale."""
        return latent[:, 0].float() * self.vae_scale

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """uint8 RGB [H, W, 3] of a model-space latent [1, 1, c, h, w]."""
        return to_uint8(self._decoder().decode(self.decoder_latent(latent))[0])

    def _decoder(self) -> FrameDecoder:
        if self.decoder is None:
            raise RuntimeError("this pipeline was built without a decoder (the autoencoder)")
        return self.decoder

    get_state, load_state, save_state = snapshot.get_state, snapshot.load_state, snapshot.save_state

    def close(self):
        """The run ends: the ring guard's checksum line if its window never closed; rank 0 of a TP
        or two-stage run: the other ranks stop (after a final check)."""
        self._say_guard_report(final=True)
        if isinstance(self.stages, FirstStage):
            return self.stages.stop()
        return self.tp.stop() if self.tp is not None else None
