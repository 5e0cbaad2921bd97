"""Fidelity of a world model against the simulator it was trained on.

Start from the simulator's real history (encoded), follow its recorded actions and compare
decoded frames with what the simulator really shows under the same actions:
- teacher-forced next-frame PSNR/SSIM (after each prediction, the real frame enters the history);
- autoregressive PSNR/SSIM per frame index;
- action sensitivity gap: PSNR with the true actions minus PSNR with another episode's;
- two diagnostics of what the model learned: the PSNR of simply repeating the last real frame
  (a next-frame predictor should beat it) and the action response, the PSNR between two
  predictions from the same history and noise under true and foreign actions (high: the
  controls barely change the frame);
- turn following: under a held turn (mouse x) the view slides sideways; the model's mean
  horizontal shift per frame as a share of the simulator's from the same state (1: turns as
  the world does, 0: ignores the mouse);
- the same questions put to the simulator itself (``simulator_responses``): how much the
  controls change the real next frame, and how far from the real frames a world that follows
  foreign controls perfectly ends up, which is what the model's numbers are measured against.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from .data import OPEN_WALL, level_clip, wall_ahead
from .simulator import MazeSim, SimConfig
from .worlds import pipeline_sim_config


def frame_metrics(pred: np.ndarray, real: np.ndarray) -> tuple[float, float]:
    """PSNR (dB) and SSIM of two uint8 HxWx3 frames."""
    p = torch.from_numpy(np.ascontiguousarray(pred)).permute(2, 0, 1)[None].float()
    r = torch.from_numpy(np.ascontiguousarray(real)).permute(2, 0, 1)[None].float()
    return (float(peak_signal_noise_ratio(p, r, data_range=255.0)),
            float(structural_similarity_index_measure(p, r, data_range=255.0)))


LAYOUT_FACTOR = 4  # the layout score compares frames averaged over 4x4 pixel blocks
LAPLACIAN = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])


def layout_psnr(pred: np.ndarray, real: np.ndarray, factor: int = LAYOUT_FACTOR) -> float:
    """PSNR (dB) of two uint8 HxWx3 frames averaged over ``factor`` x ``factor`` blocks: whether
    the walls, openings and floor are where the simulator has them, with blur not counted."""
    p, r = (torch.nn.functional.avg_pool2d(torch.from_numpy(np.ascontiguousarray(f)).permute(2, 0, 1)[None].float(),
                                           factor) for f in (pred, real))
    return float(peak_signal_noise_ratio(p, r, data_range=255.0))


def high_frequency_energy(images: torch.Tensor) -> torch.Tensor:
    """The mean squared Laplacian of the grey levels of images [N, C, H, W], one value per image
    (edges, texture; a smooth band of one colour has almost none). Differentiable."""
    grey = images.float().mean(1, keepdim=True)
    return torch.nn.functional.conv2d(grey, LAPLACIAN[None, None].to(grey.device)).pow(2).mean((1, 2, 3))


def sharpness(frame: np.ndarray) -> float:
    """High-frequency energy of a uint8 HxWx3 frame (``high_frequency_energy``)."""
    return float(high_frequency_energy(torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)[None])[0])


def sharpness_ratio(pred: np.ndarray, real: np.ndarray) -> float:
    """The model frame's high-frequency energy over the simulator frame's (1: as sharp; a blurred
    rollout falls towards 0)."""
    return sharpness(pred) / max(sharpness(real), 1e-6)


def rollout_metrics(pred: np.ndarray, real: np.ndarray) -> tuple[float, float, float, float]:
    """PSNR, SSIM, layout PSNR and sharpness ratio of a generated frame against the real one."""
    return (*frame_metrics(pred, real), layout_psnr(pred, real), sharpness_ratio(pred, real))


def standard_error(values) -> float:
    """Standard error of the mean of per-level figures: levels differ far more than frames of one
    level do, so a figure over 8 levels moves by this much from one set of levels to another."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")


class Episode:
    """A held-out simulator episode: real frames and actions, history encoded once. The scored
    frames begin at frame ``start`` of the level (default: the pipeline's window), after a history
    of which the pipeline loads the last window, so worlds with different windows can be scored on
    the same frames."""

    def __init__(self, pipe, seed: int, frames: int, style: str = "explore", start: int | None = None):
        start = pipe.window if start is None else start
        if start < pipe.window:
            raise ValueError(f"an episode scored from frame {start} has fewer history frames than the world's "
                             f"window of {pipe.window}; start at frame {pipe.window} or later")
        self.seed, self.start, self.sim_config = seed, start, pipeline_sim_config(pipe)
        self.clip, self.frames = level_clip(pipe.decoder, seed, start, frames, self.sim_config,
                                            name=f"eval-{seed}", style=style)

    def future(self, k: int):
        i = self.start + k
        return self.frames[i], self.clip.mouse[i], self.clip.buttons[i]


def autoregressive(pipe, ep: Episode, n: int, actions: Episode | None = None,
                   frames: list | None = None) -> list[tuple[float, float, float, float]]:
    """``rollout_metrics`` per frame index 1..n; ``actions`` substitutes another episode's
    controls; ``frames``, when given, receives the predicted uint8 frames."""
    pipe.load_clip(ep.clip)
    src = actions or ep
    out = []
    for k in range(n):
        _, m, b = src.future(k)
        frame, _ = pipe(m, b)
        out.append(rollout_metrics(frame.numpy(), ep.future(k)[0]))
        if frames is not None:
            frames.append(frame.numpy())
    return out


def scripted_rollout(pipe, ep: Episode, actions: list, frames: list | None = None) -> list[tuple[float, ...]]:
    """``rollout_metrics`` per frame of the model playing ``actions`` ((mouse, buttons) pairs, as
    ``inference.actions`` scripts them) from the episode's real history, against the simulator
    playing them from the same state; ``frames``, when given, receives (simulator's, model's)
    frames [n, H, W, 3]."""
    sim = replay(ep, ep.start)
    pipe.load_clip(ep.clip)
    real, made = [], []
    for mouse, buttons in actions:
        made.append(pipe(mouse, buttons)[0].numpy())
        real.append(sim.step(mouse, buttons))
    if frames is not None:
        frames.append((np.stack(real), np.stack(made)))
    return [rollout_metrics(m, r) for m, r in zip(made, real)]


def rollout_sheet(rows: list[tuple[np.ndarray, ...]], every: int, gap: int = 2) -> np.ndarray:
    """One uint8 image of aligned frame sequences [n, H, W, 3], typically (real, predicted): for
    each tuple a row per sequence (the real frames above the predictions), frame indices 1,
    1 + every, ... as columns, ``gap`` white pixels between tuples; what the PSNR curve means, to the eye.
    Tuples may hold different numbers of frames (shorter rows end in white)."""
    blocks = []
    for seqs in rows:
        if any(s.shape != seqs[0].shape for s in seqs):
            raise ValueError(f"rollout_sheet: the sequences of one row differ in shape "
                             f"({', '.join(str(tuple(s.shape)) for s in seqs)}); pass aligned frames [n, H, W, 3]")
        pick = slice(0, len(seqs[0]), every)
        blocks.append(np.concatenate([np.concatenate(list(s[pick]), axis=1) for s in seqs]))
    # a shorter tuple (the last row of a contact sheet) is padded on the right with white
    width = max(b.shape[1] for b in blocks)
    rows = []
    for block in blocks:
        block = np.pad(block, ((0, 0), (0, width - block.shape[1]), (0, 0)), constant_values=255)
        rows += [block, np.full((gap, width, 3), 255, np.uint8)]
    return np.concatenate(rows[:-1])


def observe_frame(pipe, frame: np.ndarray, mouse, buttons):
    """Teacher forcing: a real uint8 frame (encoded) enters the history with its actions."""
    pipe.observe(pipe.decoder.encode_uint8(frame[None])[None] / pipe.vae_scale, mouse, buttons)


def observe_real(pipe, ep: Episode, k: int):
    """The episode's real future frame k enters the history."""
    observe_frame(pipe, *ep.future(k))


def teacher_forced(pipe, ep: Episode, n: int, frames: list | None = None,
                   latents: list | None = None) -> list[tuple[float, float]]:
    """Metrics of each next frame 1..n predicted from the real history; ``frames``, when given,
    receives the predicted uint8 frames, ``latents`` the predicted model-space latents [1, 1, c, h, w]."""
    pipe.load_clip(ep.clip)
    out = []
    for k in range(n):
        real, m, b = ep.future(k)
        latent = pipe.generate(m, b, commit=False)
        frame = pipe.decode(latent).numpy()
        out.append(frame_metrics(frame, real))
        if frames is not None:
            frames.append(frame)
        if latents is not None:
            latents.append(latent)
        observe_real(pipe, ep, k)
    return out


def copy_previous(ep: Episode, n: int) -> list[tuple[float, float]]:
    """Metrics of predicting each next frame as the last real one (no model)."""
    return [frame_metrics(ep.frames[ep.start + k - 1], ep.future(k)[0]) for k in range(n)]


def action_response(pipe, ep: Episode, other: Episode, n: int) -> list[float]:
    """Teacher-forced PSNR between predictions under ``ep``'s and ``other``'s actions (same noise)."""
    pipe.load_clip(ep.clip)
    out = []
    for k in range(n):
        noise = pipe.noise()
        mine, theirs = (pipe.decode(pipe.generate(*src.future(k)[1:], noise=noise, commit=False)).numpy()
                        for src in (ep, other))
        out.append(frame_metrics(mine, theirs)[0])
        observe_real(pipe, ep, k)
    return out


def replay_level(seed: int, config: SimConfig, mouse, buttons) -> MazeSim:
    """Level ``seed`` of the simulator ``config`` after the recorded actions (mouse [n, 2],
    buttons [n, 11]): the state their last frame shows (the simulator is deterministic and
    recorded actions are stored exactly as they were played)."""
    sim = MazeSim(seed, config)
    sim.render()
    for m, b in zip(mouse, buttons):
        sim.step(m.tolist(), b.tolist())
    return sim


def replay(ep: Episode, frames: int) -> MazeSim:
    """The episode's simulator after its first ``frames`` recorded actions."""
    return replay_level(ep.seed, ep.sim_config, ep.clip.mouse[:frames], ep.clip.buttons[:frames])


def replay_clip(clip, height: int, width: int) -> MazeSim:
    """The simulator at the end of a clip's history (the state its last history frame shows),
    rendering at height x width, so it can play on beside the model under the same actions.
    The clip must record its level (clips rendered from one do; ``owl_wms.clips``)."""
    if clip.level is None:
        raise ValueError(f"clip {clip.name!r} does not record the simulator level it was rendered from, so the "
                         f"simulator cannot replay it; start from a fresh level (--world-seed N) or re-export "
                         f"the checkpoint's clips with scripts.export_checkpoint")
    try:
        config = SimConfig(**{**clip.level["simulator"], "height": height, "width": width})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"clip {clip.name!r} records simulator options {clip.level['simulator']} that this "
                         f"simulator does not take: {exc}") from exc
    n = clip.history_frames
    return replay_level(int(clip.level["seed"]), config, clip.mouse[:n], clip.buttons[:n])


def simulator_responses(ep: Episode, other: Episode, n: int, gap: tuple[int, int]) -> dict:
    """What the controls do in the simulator, from the episode's real states (no model):
    - ``previous_action``: PSNR of each real next frame (1..n) against the frame the previous
      frame's action would have made from the same state: what the current action adds to
      the motion so far;
    - ``foreign_action``: the same against ``other``'s action for that frame;
    - ``foreign_rollout``: PSNR to the real frames of the simulator following ``other``'s
      actions from the end of the history, mean over frame indices ``gap`` (1-based): what a
      model that follows the controls perfectly scores there with foreign actions."""
    sim = replay(ep, ep.start)
    start = copy.deepcopy(sim)
    prev, foreign = [], []
    for k in range(n):
        real, m, b = ep.future(k)
        for out, (am, ab) in ((prev, (ep.clip.mouse[ep.start + k - 1], ep.clip.buttons[ep.start + k - 1])),
                              (foreign, other.future(k)[1:])):
            out.append(frame_metrics(copy.deepcopy(sim).step(am.tolist(), ab.tolist()), real)[0])
        sim.step(m.tolist(), b.tolist())
    lo, hi = gap
    rollout = [frame_metrics(start.step(*(a.tolist() for a in other.future(k)[1:])), ep.future(k)[0])[0]
               for k in range(hi)]
    return {"previous_action": prev, "foreign_action": foreign, "foreign_rollout": float(np.mean(rollout[lo - 1:hi]))}


def horizontal_shift(a: np.ndarray, b: np.ndarray, max_shift: int = 12) -> int:
    """Columns by which the view moved from frame ``a`` to frame ``b`` (HxWx3 uint8): the integer
    shift whose overlap has the least squared difference of grey levels (positive: content
    moved left, as when turning right)."""
    x, y = (torch.from_numpy(np.ascontiguousarray(f)).float().mean(-1) for f in (a, b))
    w = x.shape[1]
    shifts = list(range(-max_shift, max_shift + 1))
    err = [float(((x[:, max(s, 0):w + min(s, 0)] - y[:, max(-s, 0):w + min(-s, 0)]) ** 2).mean()) for s in shifts]
    return shifts[int(np.argmin(err))]


def held_controls_psnr(pipe, ep: Episode, mouse: list[float], buttons: list[float], n: int) -> list[float]:
    """PSNR against the simulator of the model's frames over ``n`` frames of holding the same
    controls from the episode's real history: how a scripted walk (idle, forward, walk_turn)
    starts. With the mouse exactly at rest, (0, 0), it asks for the input a player at rest sends."""
    sim = replay(ep, ep.start)
    pipe.load_clip(ep.clip)
    return [frame_metrics(pipe(mouse, buttons)[0].numpy(), sim.step(mouse, buttons))[0] for _ in range(n)]


def turn_following(pipe, ep: Episode, dx: float, n: int, frames: list | None = None) -> dict:
    """Horizontal shift per frame (columns, signed by the turn) over ``n`` frames of walking
    forward (W) with mouse x held at ``dx`` from the episode's real history, frame by frame:
    ``model`` of the model's autoregressive frames, ``sim`` of the simulator's, ``forced`` of
    the model's teacher-forced frames (each predicted from the simulator's frames so far, shift
    measured from the last of them: the turn the model makes in one step, before its own
    frames feed back), and ``open``, whether the simulator's view had no wall nearer than
    ``OPEN_WALL`` ahead when the frame's turn was made (a turn in the open: only the mouse says
    the view turns). ``frames``, when given, receives (simulator's, teacher-forced,
    autoregressive) frames [n, H, W, 3] after the last real one."""
    mouse, buttons = [float(dx), 0.0], [1.0] + [0.0] * 10
    sim = replay(ep, ep.start)
    real, is_open = [ep.frames[ep.start - 1]], []
    for _ in range(n):
        is_open.append(wall_ahead(sim) >= OPEN_WALL)
        real.append(sim.step(mouse, buttons))
    pipe.load_clip(ep.clip)
    made = [ep.frames[ep.start - 1]] + [pipe(mouse, buttons)[0].numpy() for _ in range(n)]
    pipe.load_clip(ep.clip)
    forced = []
    for frame in real[1:]:
        forced.append(pipe.decode(pipe.generate(mouse, buttons, commit=False)).numpy())
        observe_frame(pipe, frame, mouse, buttons)
    if frames is not None:
        frames.append((np.stack(real[1:]), np.stack(forced), np.stack(made[1:])))
    sign = float(np.sign(dx))
    shifts = lambda pairs: [sign * horizontal_shift(a, b) for a, b in pairs]  # noqa: E731
    return {"model": shifts(zip(made[:-1], made[1:])), "sim": shifts(zip(real[:-1], real[1:])),
            "forced": shifts(zip(real[:-1], forced)), "open": is_open}


def turn_following_summary(turns: list[dict]) -> dict:
    """The turn diagnostic's figures over runs of ``turn_following``: mean shift per frame of the
    model's rollout, the simulator and the model's one step, and the model's as shares of the
    simulator's, over all frames and separately over turns made in the open and at a near wall
    (a share is None where no frame of that kind was seen)."""
    out = {}
    for where, keep in (("", lambda o: True), ("_open", lambda o: o), ("_near_wall", lambda o: not o)):
        picked = {k: [s for r in turns for s, o in zip(r[k], r["open"]) if keep(o)] for k in ("model", "sim", "forced")}
        mean = {k: float(np.mean(v)) if v else None for k, v in picked.items()}
        share = lambda k: mean[k] / mean["sim"] if mean[k] is not None and mean["sim"] else None  # noqa: E731
        out.update({f"turn_shift_model{where}": mean["model"], f"turn_shift_sim{where}": mean["sim"],
                    f"turn_shift_teacher_forced{where}": mean["forced"], f"turn_following{where}": share("model"),
                    f"turn_following_teacher_forced{where}": share("forced"),
                    f"turn_frames_counted{where}": len(picked["sim"])})
    return out
