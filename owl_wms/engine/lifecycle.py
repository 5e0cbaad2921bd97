"""Cache lifecycle: every change to the KV cache is one ``StepPlan``, made by ``Lifecycle``.

    EMPTY --cut--> RESET --frame--> STEADY --frame--> STEADY ...
                                      |--recompute (every N frames)--> RECOMPUTE --frame--> STEADY
    any phase --cut--> RESET (a new epoch)          observe (teacher forcing) keeps the phase

A plan says everything a step does: whether the cache restarts from a history (a hard cut
starts a new epoch; a recompute keeps the epoch and re-bases positions to zero), the frames
written first, the frame's controls and noise, the soft-forgetting bias, and how many model
calls it makes. The pipeline executes plans and nothing else touches the cache. In a
tensor-parallel run the plan is the envelope rank 0 broadcasts (owl_wms/parallel.py), so
every rank executes the same step from the same data.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..controls import N_BUTTONS, no_controls

ENVELOPE_VERSION = 1


class LifecycleError(RuntimeError):
    """A step was planned or received out of order (the message says which and why)."""


class Phase(str, Enum):
    EMPTY = "empty"
    RESET = "reset"
    STEADY = "steady"
    RECOMPUTE = "recompute"


# event -> phases it may follow
ALLOWED = {
    "cut": {Phase.EMPTY, Phase.RESET, Phase.STEADY, Phase.RECOMPUTE},
    "frame": {Phase.RESET, Phase.STEADY, Phase.RECOMPUTE},
    "recompute": {Phase.STEADY},
    "observe": {Phase.RESET, Phase.STEADY},
    "stop": set(Phase),
}


@dataclass
class StepPlan:
    """One pipeline step. ``history``: model-space frames [n, c, h, w] written to the cache
    before the frame (already noised at alpha), with their controls; ``reset``: they replace
    the cache and positions restart at zero. ``noise`` is None for steps without a frame."""
    event: str
    call_id: int
    epoch: int
    frame_index: int  # frames added to the history this epoch (generated or observed) before this step
    bias: float
    expected_calls: int
    reset: bool = False
    history: torch.Tensor | None = None
    history_mouse: torch.Tensor | None = None
    history_buttons: torch.Tensor | None = None
    mouse: torch.Tensor | None = None
    buttons: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    commit: bool = True
    version: int = ENVELOPE_VERSION

    @property
    def generates(self) -> bool:
        return self.noise is not None

    def summary(self) -> str:
        return (f"call {self.call_id} {self.event} epoch={self.epoch} frame={self.frame_index} "
                f"bias={self.bias:g} calls={self.expected_calls}")


def check_history(history, mouse=None, buttons=None, *, window: int, channels: int, size: int):
    """(history, mouse, buttons) of a new history: [n <= window, c, h, w] latents with [n, 2]
    mouse and [n, 11] buttons (default: no input); anything else is refused."""
    n = history.shape[0]
    none_m, none_b = no_controls(n)
    mouse = none_m if mouse is None else torch.as_tensor(mouse, dtype=torch.float32)
    buttons = none_b if buttons is None else torch.as_tensor(buttons, dtype=torch.float32)
    if (history.ndim != 4 or not 1 <= n <= window or tuple(history.shape[1:]) != (channels, size, size)
            or tuple(mouse.shape) != (n, 2) or tuple(buttons.shape) != (n, N_BUTTONS)):
        raise ValueError(f"history {tuple(history.shape)}, mouse {tuple(mouse.shape)}, buttons "
                         f"{tuple(buttons.shape)}; expected [n <= {window}, {channels}, {size}, {size}], [n, 2], "
                         f"[n, {N_BUTTONS}]")
    return history, mouse, buttons


class Lifecycle:
    """Plans steps and tracks the phase, epoch and counters (the scalars TP ranks compare)."""

    def __init__(self, n_steps: int, recompute_every: int = 0, bias: float = 0.0):
        self.n_steps = n_steps  # model calls per generated frame
        self.recompute_every = recompute_every
        self.bias = float(bias)
        self.phase = Phase.EMPTY
        self.epoch = 0
        self.call_id = 0  # plans made (the next plan's id)
        self.frame_index = 0  # frames added to the history this epoch (generated or observed)
        self.since_anchor = 0  # frames committed since the last cut or recompute
        self.cached_frames = 0  # frames the cache holds since its last reset (its offset, in frames)
        self.model_calls = 0  # model calls executed (counted by the pipeline)
        self.event = "none"  # the last executed event

    def set_bias(self, value: float) -> None:
        """Soft forgetting: from the next step, cached history keys get this attention-logit bias."""
        if not -100 <= float(value) <= 100:
            raise ValueError(f"kv_cache_attention_bias={value!r} must be a number in [-100, 100] (0: off)")
        self.bias = float(value)

    # -- planning ------------------------------------------------------------------------------
    def _plan(self, event: str, calls: int, **fields) -> StepPlan:
        if self.phase not in ALLOWED[event]:
            raise LifecycleError(f"cannot {event} in phase {self.phase.value}: "
                                 + ("load a history first (hard_cut / load_clip)" if self.phase is Phase.EMPTY
                                    else f"allowed after {sorted(p.value for p in ALLOWED[event])}"))
        epoch = self.epoch + 1 if event == "cut" else self.epoch
        frame = 0 if event == "cut" else self.frame_index
        return StepPlan(event, self.call_id, epoch, frame, self.bias, calls, **fields)

    def cut(self, history, mouse, buttons) -> StepPlan:
        return self._plan("cut", 1, reset=True, history=history, history_mouse=mouse, history_buttons=buttons)

    @property
    def recompute_due(self) -> bool:
        return bool(self.recompute_every) and self.since_anchor >= self.recompute_every \
            and self.phase is Phase.STEADY

    def frame(self, mouse, buttons, noise, commit: bool = True, anchor=None) -> StepPlan:
        """``anchor`` = (history, mouse, buttons) turns this step into a recompute + frame."""
        if anchor is not None:
            return self._plan("recompute", 1 + self.n_steps, reset=True, history=anchor[0],
                              history_mouse=anchor[1], history_buttons=anchor[2], mouse=mouse,
                              buttons=buttons, noise=noise, commit=commit)
        return self._plan("frame", self.n_steps, mouse=mouse, buttons=buttons, noise=noise, commit=commit)

    def observe(self, history, mouse, buttons) -> StepPlan:
        return self._plan("observe", 1, history=history, history_mouse=mouse, history_buttons=buttons)

    def stop(self) -> StepPlan:
        return self._plan("stop", 0)

    # -- bookkeeping after a step ran -------------------------------------------------------------
    def expect(self, plan: StepPlan) -> None:
        """Check a received plan (a TP envelope) against this lifecycle before running it."""
        if plan.version != ENVELOPE_VERSION:
            raise LifecycleError(f"envelope version {plan.version}, this build speaks {ENVELOPE_VERSION}")
        if plan.call_id != self.call_id:
            raise LifecycleError(f"envelope call id {plan.call_id}, expected {self.call_id} (a step was lost "
                                 "or repeated)")
        local = self.calls_for(plan.event)
        if local is None:
            raise LifecycleError(f"envelope event {plan.event!r} is unknown")
        if plan.expected_calls != local:
            raise LifecycleError(f"envelope expects {plan.expected_calls} model calls for {plan.event}; this rank "
                                 f"plans {local} (its sampler schedule differs)")
        epoch = self.epoch + (plan.event == "cut")
        if plan.epoch != epoch:
            raise LifecycleError(f"envelope epoch {plan.epoch}, this rank is at epoch {self.epoch} "
                                 f"(expected {epoch} for {plan.event})")
        if plan.event != "cut" and plan.frame_index != self.frame_index:
            raise LifecycleError(f"envelope frame {plan.frame_index}, this rank is at frame {self.frame_index}")
        if self.phase not in ALLOWED[plan.event]:
            raise LifecycleError(f"envelope {plan.event} arrived in phase {self.phase.value}")

    def calls_for(self, event: str) -> int | None:
        """The model calls a step of ``event`` makes (None: no such event)."""
        return {"cut": 1, "frame": self.n_steps, "recompute": 1 + self.n_steps, "observe": 1, "stop": 0}.get(event)

    def advance(self, plan: StepPlan) -> None:
        self.call_id += 1
        self.bias = plan.bias
        self.event = plan.event
        if plan.event == "stop":
            return
        if plan.event == "cut":
            self.epoch, self.frame_index, self.since_anchor, self.phase = plan.epoch, 0, 0, Phase.RESET
        if plan.event == "recompute":
            self.since_anchor = 0
        if plan.reset:
            self.cached_frames = plan.history.shape[0]
        if plan.event == "observe":
            self.frame_index += 1
            self.since_anchor += 1
            self.cached_frames += 1
        if plan.generates:
            self.frame_index += plan.commit
            self.since_anchor += plan.commit
            self.cached_frames += plan.commit
            self.phase = Phase.STEADY

    def finish(self, plan: StepPlan, calls: int) -> None:
        """After ``plan`` ran in ``calls`` model calls: the counters follow, and a count other
        than the plan's fails fast (a step that skipped or repeated a model call)."""
        self.model_calls += calls
        self.advance(plan)
        if calls != plan.expected_calls:
            raise LifecycleError(f"made {calls} model calls in step {plan.summary()}; the plan expected "
                                 f"{plan.expected_calls}")

    def scalars(self) -> list[float]:
        """What every TP rank must agree on (compared by the periodic all-gather)."""
        return [self.epoch, self.call_id, self.frame_index, self.since_anchor, self.model_calls, self.bias,
                self.cached_frames]

    SCALAR_NAMES = ("epoch", "call_id", "frame", "since_anchor", "model_calls", "bias", "cached_frames")

    def state(self) -> dict:
        return {"phase": self.phase.value, "epoch": self.epoch, "call_id": self.call_id,
                "frame_index": self.frame_index, "since_anchor": self.since_anchor,
                "model_calls": self.model_calls, "bias": self.bias, "event": self.event,
                "cached_frames": self.cached_frames}

    def load_state(self, state: dict) -> None:
        self.phase = Phase(state["phase"])
        for key in ("epoch", "call_id", "frame_index", "since_anchor", "model_calls"):
            setattr(self, key, int(state[key]))
        self.bias, self.event = float(state["bias"]), state["event"]
        self.cached_frames = int(state.get("cached_frames", 0))  # states saved before it was counted
