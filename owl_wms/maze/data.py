"""Episodes for training: a scripted exploring policy driving the maze simulator.

The policy holds keys with persistence (mostly walking forward), moves the mouse smoothly
(an Ornstein-Uhlenbeck process), turns away from walls it is about to hit, and now and then
uses every other button (sprint, jump, reload, flashlight, interact, fire, zoom).

A data policy is one style or a mixture (``still+explore``: episodes take the styles in turn).
Styles differ only in the mouse process. ``explore`` (the shipped world's data) moves it slowly
and smoothly, so the past frames already predict most of the next turn and a model can do well
without reading the controls; it turns hard only when a wall is close ahead, so in its episodes
a hard turn nearly always faces a wall up close (``turn_wall_statistics``). ``lively`` turns
faster with less persistence, so the next view depends on the action far more than on the
motion so far. ``still`` sometimes lets go of the mouse; ``sweep`` and ``roam`` (from still) also
turn in the open, by held turns anywhere or by turning away from walls while they are still far.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..clips import Clip
from ..controls import N_BUTTONS
from .simulator import D_, E_, F_, LMB, R_, RMB, SHIFT, SPACE, A_, S_, W_, MazeSim, SimConfig


HELD_OUT_SEED = 1_000_000  # level seeds at or above this are never used for training

# generate_data's options that change what episodes show, and their defaults (what a manifest
# written before the option existed holds): the policy's style and SimConfig's corridor width
EPISODE_OPTIONS = {"policy": "explore", "corridor": 1, "look": "brick"}


def episode_options(manifest: dict) -> dict:
    """The episode options a data manifest was made with, defaults filled in."""
    return {key: manifest.get(key, default) for key, default in EPISODE_OPTIONS.items()}


@dataclasses.dataclass(frozen=True)
class PolicyStyle:
    persist: float  # mouse persistence per frame
    innovation: float  # weight of the new draw (written out, not 1 - persist, so "explore" stays
    mouse_std: tuple[float, float]  # bit-identical to the data the earlier worlds learned); its std [dx, dy]
    still_start: float = 0.0  # per-frame chance to let go of the mouse: it then sends exactly (0, 0),
    still_hold: float = 0.0  # as a player at rest does; chance per frame to keep it let go
    sweep_start: float = 0.0  # per-frame chance to start holding a turn wherever the player is,
    sweep_hold: float = 0.0  # not only at a close wall; chance per frame to keep holding it
    sweep_rate: tuple[float, float] = (0.0, 0.0)  # |mouse x| of a held turn, drawn uniformly
    avoid_near: float = 0.9  # start turning away when a wall is this close ahead (middle third of the view),
    avoid_clear: float = 1.6  # stop once the nearest one there is this far
    retarget: float = 0.0  # per-frame chance to draw a new turn rate (mouse x) wherever the player is, walking
    retarget_rest: float = 0.0  # or not; the chance that the new rate is no turn at all;
    retarget_rate: tuple[float, float] = (0.0, 0.0)  # |mouse x| of the others, drawn uniformly


# "still": explore, but about a quarter of the frames (stretches of about 9) leave the mouse alone,
# so a world learns the (0, 0) that idle, forward, walk_turn and a resting player send: explore
# never sends it, and a world trained on explore alone answers it worse than any small motion
POLICY_STYLES = {"explore": PolicyStyle(0.85, 0.15, (7.0, 2.0)), "lively": PolicyStyle(0.5, 0.5, (12.0, 4.0)),
                 "still": PolicyStyle(0.85, 0.15, (7.0, 2.0), still_start=0.05, still_hold=0.9)}
# "sweep": still, plus turns held for about 14 frames at 3-9 mouse units wherever the player is.
# In the other styles a hard turn comes only from a close wall ahead (turn_wall_statistics: 99% of
# still's), so a world learns "turning = a wall fills the view" and dreams one under a scripted turn
# in the open; in sweep's episodes (2-wide corridors) 8% of all frames turn hard in the open
POLICY_STYLES["sweep"] = dataclasses.replace(POLICY_STYLES["still"], sweep_start=0.04, sweep_hold=0.93,
                                             sweep_rate=(3.0, 9.0))
# "roam": still, but turning away from a wall 2 units ahead (not 0.9) until it is 3 away (not 1.6):
# in 2-wide corridors its steady frames almost never face a near wall (0.2% against still's 31%)
# and 16% of all its frames turn hard in the open, where still's near-wall frames teach a world
# that walking forward ends at a wall filling the view
POLICY_STYLES["roam"] = dataclasses.replace(POLICY_STYLES["still"], avoid_near=2.0, avoid_clear=3.0)
# "turns": turns of random strength and length wherever the player is, walking or standing: each
# frame draws a new turn rate with chance 0.4 (0.4 of them no turn), so a turn lasts about 2.5
# frames and the mouse's lag-1 autocorrelation is 0.78 (still's: 0.93, so a world reads the next
# turn off the history and can ignore the mouse); 22% of all frames turn hard in the open (still:
# 0.3%), where only the mouse says that the view turns (scripts.policy_stats, corridor 2)
POLICY_STYLES["turns"] = dataclasses.replace(POLICY_STYLES["still"], persist=0.5, innovation=0.5,
                                             mouse_std=(1.5, 1.5), retarget=0.4, retarget_rest=0.4,
                                             retarget_rate=(1.0, 12.0), avoid_near=1.2, avoid_clear=2.0)


OPEN_WALL = 1.6  # a frame whose nearest wall ahead is at least this far (grid units) looks into the open
HARD_TURN = 5.0  # a frame whose |mouse x| exceeds this turns hard


def wall_ahead(sim: MazeSim) -> float:
    """Distance to the nearest wall in the middle third of the simulator's last rendered view
    (grid units; 9 before the first render): whether a turn happens in the open or at a wall."""
    depth = sim.depth if sim.depth is not None else np.full(sim.cfg.width, 9.0)
    return float(depth[len(depth) // 3: 2 * len(depth) // 3].min())


def policy_mixture(spec: str) -> tuple[str, ...]:
    """Styles of a data policy spec: one style ("still"), or several joined by "+"
    ("still+explore"), which episodes take in turn (``episode_style``)."""
    parts = tuple(spec.split("+"))
    bad = [p for p in parts if p not in POLICY_STYLES]
    if bad:
        raise ValueError(f"policy {spec!r}: unknown style {bad[0]!r}; use one of {sorted(POLICY_STYLES)} "
                         "or several joined by '+', e.g. still+explore")
    return parts


def episode_style(spec: str, index: int) -> str:
    """The style of the ``index``-th episode (0-based, from the run's first level seed) of ``spec``."""
    parts = policy_mixture(spec)
    return parts[index % len(parts)]


class ExplorerPolicy:
    # Per-frame chance to start pressing / keep holding each button.
    START = {W_: 0.10, S_: 0.015, A_: 0.02, D_: 0.02, SHIFT: 0.02, SPACE: 0.02, R_: 0.008,
             F_: 0.01, E_: 0.03, LMB: 0.02, RMB: 0.01}
    HOLD = {W_: 0.95, S_: 0.8, A_: 0.8, D_: 0.8, SHIFT: 0.9, SPACE: 0.3, R_: 0.3,
            F_: 0.2, E_: 0.3, LMB: 0.7, RMB: 0.9}

    def __init__(self, seed: int, style: str = "explore"):
        if style not in POLICY_STYLES:
            raise ValueError(f"unknown policy style {style!r}; choose one of {sorted(POLICY_STYLES)}")
        self.style = POLICY_STYLES[style]
        self.persist, self.innovation, self.mouse_std = self.style.persist, self.style.innovation, self.style.mouse_std
        self.rng = np.random.default_rng(seed)
        self.still = False  # the mouse let go
        self.held = np.zeros(N_BUTTONS, dtype=bool)
        self.mouse = np.zeros(2)
        self.turn = 0.0  # committed turn (mouse x) while avoiding a wall
        self.sweep = 0.0  # held turn (mouse x) in the open
        self.rate = 0.0  # turn rate (mouse x) of the current retargeted turn

    def act(self, sim: MazeSim) -> tuple[list[float], list[int]]:
        rng = self.rng
        for k in range(N_BUTTONS):
            p = self.HOLD[k] if self.held[k] else self.START[k]
            self.held[k] = rng.random() < p
        if self.held[S_]:
            self.held[W_] = False
        self.mouse = self.persist * self.mouse + self.innovation * rng.normal(0, self.mouse_std)
        self.mouse[1] += 0.08 * sim.state.tilt / sim.cfg.tilt_per_px  # drift the view back level
        centre = wall_ahead(sim)
        if self.style.still_start:  # no draw otherwise: explore and lively stay bit-identical
            self.still = rng.random() < (self.style.still_hold if self.still else self.style.still_start)
        if self.style.sweep_start:  # no draw otherwise, as for still
            if self.sweep == 0.0 and rng.random() < self.style.sweep_start:
                self.sweep = float(rng.choice([-1, 1]) * rng.uniform(*self.style.sweep_rate))
            elif self.sweep != 0.0 and rng.random() >= self.style.sweep_hold:
                self.sweep = 0.0
        if self.style.retarget and rng.random() < self.style.retarget:  # no draw otherwise, as for still
            rest = rng.random() < self.style.retarget_rest
            self.rate = 0.0 if rest else float(rng.choice([-1, 1]) * rng.uniform(*self.style.retarget_rate))
        if self.turn == 0.0 and centre < self.style.avoid_near:
            self.turn = float(rng.choice([-1, 1]) * rng.uniform(6, 12))
        elif centre > self.style.avoid_clear:
            self.turn = 0.0
        if self.still and self.turn == 0.0 and self.sweep == 0.0 and self.rate == 0.0:
            self.mouse = np.zeros(2)  # at rest: when the hand comes back, the motion starts from zero
            return [0.0, 0.0], self.held.astype(int).tolist()
        self.still = False  # a close wall or a held turn brings the hand back
        # a close wall overrides a sweep or a retargeted turn
        mouse = self.mouse + np.array([self.turn or self.sweep or self.rate, 0.0])
        return [round(float(mouse[0]), 3), round(float(mouse[1]), 3)], self.held.astype(int).tolist()


def rollout_episode(level_seed: int, frames: int, policy_seed: int | None = None,
                    config: SimConfig | None = None, then: list | None = None, style: str = "explore",
                    watch=None):
    """frames uint8 [n, H, W, 3], mouse float32 [n, 2], buttons float32 [n, 11];
    frame i is what the simulator shows after action i. ``then`` (a list of (mouse, buttons))
    continues the episode after the policy's ``frames`` with given actions (n grows by len(then)).
    ``watch(sim, mouse)``, when given, sees the simulator as each action is chosen, before the step."""
    sim = MazeSim(level_seed, config)
    sim.render()
    policy = ExplorerPolicy(level_seed * 7 + 1 if policy_seed is None else policy_seed, style)
    then = list(then or [])
    n = frames + len(then)
    out = np.empty((n, sim.cfg.height, sim.cfg.width, 3), dtype=np.uint8)
    mouse = np.empty((n, 2), dtype=np.float32)
    buttons = np.empty((n, N_BUTTONS), dtype=np.float32)
    for i in range(n):
        m, b = policy.act(sim) if i < frames else then[i - frames]
        if watch is not None:
            watch(sim, m)
        out[i] = sim.step(m, b)
        mouse[i], buttons[i] = m, b
    return out, mouse, buttons


def level_clip(coder, seed: int, window: int, future: int, config: SimConfig, name: str | None = None,
               style: str = "explore"):
    """A clip that starts on a level of the simulator ``config`` (owl_wms/maze/worlds.py ``sim_config``):
    ``window`` history frames encoded with ``coder`` (a FrameDecoder) plus ``future`` recorded
    policy actions. Returns (clip, the level's uint8 frames [window + future, H, W, 3])."""
    frames, mouse, buttons = rollout_episode(seed, window + future, config=config, style=style)
    clip = Clip(coder.encode_uint8(frames[:window]), torch.from_numpy(mouse), torch.from_numpy(buttons), window,
                name=name or f"level-{seed}", level={"seed": seed, "simulator": dataclasses.asdict(config)})
    return clip, frames


def turn_wall_statistics(style: str, levels: int = 16, frames: int = 256, big: float = HARD_TURN,
                         near: float = OPEN_WALL, corridor: int = 1) -> dict:
    """How the policy's turns go with walls: the share of frames whose mouse x exceeds ``big``
    in size, and for those and for the rest (|mouse x| < 2) the median distance to the nearest
    wall in the middle third of the view and the share with one nearer than ``near``: what a
    world model trained on the policy's episodes (in a maze of ``corridor``-wide passages) is
    asked to show under a turn; the share of all frames that turn hard with no wall that near
    (what a scripted turn in the open asks for); the share with the mouse exactly at rest, (0, 0);
    and the lag-1 autocorrelation of mouse x (near 1: the history already says what the next
    turn is, so a world can ignore the mouse)."""
    turning, steady, at_rest = [], [], []

    def watch(sim: MazeSim, mouse):
        depth = wall_ahead(sim)
        at_rest.append(mouse[0] == 0 and mouse[1] == 0)
        if abs(mouse[0]) > big:
            turning.append(depth)
        elif abs(mouse[0]) < 2:
            steady.append(depth)

    pairs = []
    for seed in range(levels):  # the training episodes of these levels, as generate_data makes them
        _, mouse, _ = rollout_episode(seed, frames, style=style, watch=watch, config=SimConfig(corridor=corridor))
        pairs.append(np.stack([mouse[:-1, 0], mouse[1:, 0]]))
    turning, steady = np.array(turning), np.array(steady)
    return {"style": style, "corridor": corridor, "turning_share": len(turning) / (levels * frames),
            "turning_median_wall": float(np.median(turning)), "steady_median_wall": float(np.median(steady)),
            "turning_near_share": float((turning < near).mean()), "steady_near_share": float((steady < near).mean()),
            "turning_open_share": float((turning >= near).sum() / (levels * frames)),
            "at_rest_share": float(np.mean(at_rest)),
            "mouse_x_autocorrelation": float(np.corrcoef(np.concatenate(pairs, axis=1))[0, 1])}
