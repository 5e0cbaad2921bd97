"""World-model training: rectified flow with diffusion forcing on encoded episodes.

x_t = (1 - t) x + t z, target v = z - x. Two kinds of sample are mixed:
- diffusion forcing: t = sigmoid(randn) drawn independently per frame;
- pipeline-shaped: every frame but the last at t = alpha (the streaming history), the last
  frame at a step of the sampling schedule, so the few-step sampler sees its own inputs.
A fine-tune may distil the sampler's first step from a many-step teacher (``teacher_first_step``).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file

from ...cache import StaticCache
from ..data import HARD_TURN, OPEN_WALL
from ...model import GameRFT
from ...sampler import euler
from . import warmup_cosine


class LatentEpisodes:
    """All encoded episodes in memory; windows of ``frames`` consecutive frames.

    ``open_turn_weight`` > 0 draws windows in proportion to 1 + weight x their share of frames
    that turn hard (|mouse x| > HARD_TURN) with no wall near ahead (episodes from generate_data record
    ``wall_ahead``), so training sees the turns only the mouse explains; 0 draws uniformly."""

    def __init__(self, folder: str | Path, vae_scale: float, frames: int, open_turn_weight: float = 0.0):
        paths = sorted(Path(folder).glob("ep_*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no encoded episodes in {str(folder)!r}; run scripts.encode_latents first")
        eps = [load_file(str(p)) for p in paths]
        self.latents = [e["latents"].float() / vae_scale for e in eps]
        self.mouse = [e["mouse"].float() for e in eps]
        self.buttons = [e["buttons"].float() for e in eps]
        self.frames = frames
        if min(x.shape[0] for x in self.latents) < frames:
            raise ValueError(f"episodes are shorter than the training window of {frames} frames")
        self.window_weights = None
        if open_turn_weight < 0:
            raise ValueError(f"open_turn_weight {open_turn_weight} must be >= 0 (0: uniform windows)")
        if open_turn_weight > 0:
            lacking = [p.name for p, e in zip(paths, eps) if "wall_ahead" not in e]
            if lacking:
                raise ValueError(f"open_turn_weight needs each episode's wall_ahead record, which {lacking[0]} "
                                 f"(and {len(lacking) - 1} more) lacks: regenerate the data with "
                                 f"scripts.generate_data and encode it again, or use weight 0")
            self.window_weights = torch.cat([1 + open_turn_weight * self.open_turn_share(e["mouse"], e["wall_ahead"])
                                             for e in eps])
            self.starts = [(i, s) for i, x in enumerate(self.latents) for s in range(x.shape[0] - frames + 1)]

    def open_turn_share(self, mouse: torch.Tensor, wall: torch.Tensor) -> torch.Tensor:
        """Per window start, the share of its frames that turn hard in the open."""
        hits = ((mouse[:, 0].abs() > HARD_TURN) & (wall >= OPEN_WALL)).float()
        return hits.unfold(0, self.frames, 1).mean(-1)

    def batch(self, size: int, gen: torch.Generator):
        if self.window_weights is not None:
            picks = [self.starts[i] for i in torch.multinomial(self.window_weights, size, True, generator=gen).tolist()]
        else:
            ep = torch.randint(0, len(self.latents), (size,), generator=gen).tolist()
            picks = [(e, int(torch.randint(0, self.latents[e].shape[0] - self.frames + 1, (1,), generator=gen)))
                     for e in ep]
        xs, ms, bs = [], [], []
        for e, start in picks:
            s = slice(start, start + self.frames)
            xs.append(self.latents[e][s])
            ms.append(self.mouse[e][s])
            bs.append(self.buttons[e][s])
        return torch.stack(xs), torch.stack(ms), torch.stack(bs)


def sample_times(b: int, n: int, gen: torch.Generator, pipeline_frac: float, alpha: float,
                 schedule: tuple[float, ...], target_frac: float = 0.0) -> torch.Tensor:
    """Per-frame noise levels [b, n]. A pipeline-shaped sample holds its history at ``alpha``
    and its last frame at a step of the schedule; with ``target_frac`` > 0 each earlier frame
    is also such a target with that probability, so one clip trains many next-frame
    predictions from a streaming-like history instead of one (0 draws nothing extra)."""
    t = torch.sigmoid(torch.randn(b, n, generator=gen))
    pipe = torch.rand(b, generator=gen) < pipeline_frac
    k = int(pipe.sum())
    if k:
        steps = torch.tensor(schedule[:-1])
        last = steps[torch.randint(0, len(steps), (k,), generator=gen)]
        t[pipe] = alpha
        t[pipe, -1] = last
        if target_frac > 0:
            chosen = torch.rand(k, n - 1, generator=gen) < target_frac
            levels = steps[torch.randint(0, len(steps), (k, n - 1), generator=gen)]
            t[pipe, :-1] = torch.where(chosen, levels, t[pipe, :-1])
    return t


def flow_loss(core, x, mouse, buttons, t, gen: torch.Generator, self_history_share: float = 0.0,
              schedule: tuple[float, ...] = (1.0, 0.25, 0.0), teacher=None, teacher_steps: int = 0,
              self_rollout: int = 0, history_noise: float = 0.0):
    """Rectified-flow loss; ``self_history_share`` > 0: see ``own_history`` (0 draws nothing extra);
    ``history_noise`` S > 0: every real history frame of a pipeline-shaped sample (one held at the
    cache level) gets extra Gaussian noise of a standard deviation drawn from [0, S) per frame while
    its noise level still reads the cache level, and is left out of the loss (noise augmentation of
    the context, as in GameNGen: the history a rollout caches is worse than its level says, so the
    model learns not to copy its detail; 0 draws nothing extra);
    ``self_rollout`` K > 0: in every pipeline-shaped sample the last K history frames are the
    model's own rollout, made one after the other as the pipeline makes them (Self-Forcing's
    self-generated history; no extra draws); ``teacher``: step distillation of the sampler's
    first step, see ``teacher_first_step``."""
    z = torch.randn(x.shape, generator=gen).to(x)
    tt = t[:, :, None, None, None].to(x)
    x_t = (1 - tt) * x + tt * z
    target = z - x
    keep = torch.ones(t.shape, device=x.device)
    chosen = torch.zeros(t.shape, dtype=torch.bool)
    # history frames held at exactly the cache level: a pipeline-shaped sample's (diffusion forcing's never are)
    held = torch.zeros(t.shape, dtype=torch.bool)
    held[:, :-1] = t[:, :-1] == schedule[-2]
    if self_history_share > 0:
        chosen[:, :-1] = held[:, :-1] & (torch.rand(t.shape[0], t.shape[1] - 1, generator=gen) < self_history_share)
    if self_rollout > 0:
        k = min(self_rollout, t.shape[1] - 1)
        chosen[:, -1 - k:-1] |= held.any(1, keepdim=True) & held[:, -1 - k:-1]
    if history_noise > 0:
        noised = held & ~chosen
        sigma = history_noise * torch.rand(t.shape, generator=gen) * noised
        x_t = x_t + sigma[:, :, None, None, None].to(x) * torch.randn(x.shape, generator=gen).to(x)
        keep = keep * (~noised).to(x)
    if chosen.any():
        x_t = own_history(core, x_t, z, t, chosen.to(x.device), mouse.to(x), buttons.to(x), schedule,
                          sequential=self_rollout > 0)
        # A swapped frame's input no longer denoises to its real frame: it is not scored.
        keep = keep * (~chosen).to(x)
    if teacher is not None:
        first = (t == schedule[0]).to(x.device)
        last = first[:, -1]
        if last.any():
            target[last, -1] = teacher_first_step(teacher, x_t[last], t.to(x)[last], mouse.to(x)[last],
                                                  buttons.to(x)[last], schedule, teacher_steps).to(target)
        # Any other frame at t = 1 would pull the first step back to the conditional mean.
        keep[:, :-1] = keep[:, :-1] * (~first[:, :-1]).to(x)
    v = core(x_t, t.to(x), mouse.to(x), buttons.to(x))
    err = (v.float() - target.float()).pow(2).mean(dim=(2, 3, 4))
    return (err * keep).sum() / keep.sum()


@torch.no_grad()
def teacher_first_step(teacher, x_t, t, mouse, buttons, schedule: tuple[float, ...], steps: int):
    """Velocity targets [b, c, h, w] for each clip's last frame (at t = 1): the straight jump
    from its noise to the state that ``steps`` Euler steps of ``teacher`` reach at the
    schedule's next level (for 1 -> 0.25 -> 0: the state the pipeline caches).

    The two-step sampler's first step, trained on the flow loss, lands on the conditional mean
    of the next frame, blurred wherever the model is unsure; a generated frame enters the
    window in that state, and the blur compounds over a rollout. A sample of the ODE from the
    same noise is sharp, so the first step learns to jump to it (step distillation, as in
    progressive distillation with a many-step teacher). The history is prefilled into a cache
    once (as the pipeline does) and only the last frame is stepped.
    """
    b, n = x_t.shape[:2]
    kind = x_t.device.type  # keys and values come out in the autocast dtype when it is on
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else teacher.proj_in.weight.dtype
    cache = StaticCache(teacher.config, n, batch_size=b, device=x_t.device, dtype=dtype)
    cache.enable_cache_updates()
    teacher(x_t[:, :-1], t[:, :-1], mouse[:, :-1], buttons[:, :-1], kv_cache=cache)
    cache.disable_cache_updates()
    z = x_t[:, -1:]
    x, m, bt = z, mouse[:, -1:], buttons[:, -1:]
    levels = torch.linspace(schedule[0], schedule[1], steps + 1).tolist()
    x = euler(lambda x, level, _: teacher(x, torch.full((b, 1), level, device=x.device, dtype=t.dtype), m, bt,
                                          kv_cache=cache, decode_from=0).to(x),  # as the pipeline decodes a frame
              x, levels)
    return ((z - x) / (schedule[0] - schedule[1]))[:, 0]


@torch.no_grad()
def own_history(core, x_t, z, t, chosen, mouse, buttons, schedule: tuple[float, ...], sequential: bool = False):
    """Swap history frames for the model's own samples, as the pipeline makes them (exposure bias).

    At inference a generated frame enters the window as the sampler's state at the cache-write
    step (for 1 -> 0.25 -> 0: ``z - 0.75 v1`` at t = 0.25), blurrier than a real frame noised to
    0.25, and errors compound. Here each ``chosen`` frame (one held at that level) is sampled
    from its noise ``z`` by the same Euler steps, conditioned on the other frames of the clip
    as the training input shows them (no gradient, the whole batch so shapes stay fixed); the
    step then learns to predict the real frames from that history.

    ``sequential``: the chosen frames are made one frame index after the other, each seeing the
    model's own earlier frames (a rollout, as the pipeline plays: errors compound as they do
    there); otherwise all at once, each from the real frames before it (one step of exposure).
    """
    x_t = torch.where(chosen[:, :, None, None, None], z, x_t)
    columns = [chosen & (torch.arange(chosen.shape[1], device=chosen.device) == j)
               for j in chosen.any(0).nonzero().flatten().tolist()] if sequential else [chosen]
    for part in columns:
        pick = part[:, :, None, None, None]
        # Frames not picked stay as they are (a zero step); t of a picked frame is its level.
        x_t = euler(lambda x, level, _: torch.where(pick, core(x, t.to(x).masked_fill(part, level), mouse,
                                                                buttons).to(x), 0), x_t, schedule[:-1])
    return x_t


def world_trainer(model_cfg, lr: float, total_steps: int, device="cpu", compile: bool = False):
    """(model, EMA copy, AdamW, warm-up + cosine schedule) as scripts.train_world trains them;
    ``compile``: torch.compile the transformer blocks (after the EMA copy, which stays a plain
    module; weight names do not change)."""
    model = GameRFT(model_cfg).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    if compile:
        model.core.transformer.compile(histories=True, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(total_steps, max(1, total_steps // 50)))
    return model, ema, opt, sched


def train_step(model, ema, opt, sched, x, mouse, buttons, t, gen: torch.Generator, ema_decay: float,
               bf16: bool = True, self_history_share: float = 0.0,
               schedule: tuple[float, ...] = (1.0, 0.25, 0.0), teacher=None, teacher_steps: int = 0,
               self_rollout: int = 0, history_noise: float = 0.0) -> torch.Tensor:
    """One optimisation step of scripts.train_world (autocast, clipped AdamW, schedule, EMA);
    the loss, unsynchronised. ``self_history_share``, ``self_rollout``, ``teacher``,
    ``history_noise``: see ``flow_loss``."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = flow_loss(model.core, x, mouse, buttons, t, gen, self_history_share, schedule, teacher, teacher_steps,
                         self_rollout, history_noise)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - ema_decay)
    return loss
