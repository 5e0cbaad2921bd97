"""The pipeline's steps in lockstep on every tensor-parallel rank (owl_wms/parallel.py shards
the model and carries the messages).

At start-up every rank must hold the same settings, config and weights (a digest is compared).
Rank 0 plans each step and broadcasts the plan; each rank checks it against its own lifecycle
and the ranks vote before any collective, so a lost step fails every rank at once; the vote
carries each rank's cache offsets, so a cache reset or write on one rank fails them all before
the next step. A problem found after a step (a wrong number of model calls) is voted on at the
next step. Every
``check_every`` steps, and at the stop, the ranks compare their lifecycle scalars and offsets.
"""
from __future__ import annotations

from ..parallel import (
    ParallelContext,
    TPError,
    digest,
    fingerprint,
    is_collective_error,
)
from .lifecycle import Lifecycle, LifecycleError, Phase
from .stages import offsets_of


class TensorParallelSteps:
    def __init__(self, pipe, tp: ParallelContext, model):
        """Check the ranks agree and shard ``model`` (before it moves to the device)."""
        self.pipe, self.tp = pipe, tp
        tp.check_divisible(pipe.cfg)
        tp.agree(digest(pipe.settings, pipe.world, fingerprint(model)))
        tp.shard(model)
        self.step_error: str | None = None  # found after a step, voted on at the next one

    @property
    def is_leader(self) -> bool:
        return self.tp.is_leader

    def describe(self) -> str:
        return (f"[owl] tensor parallel: {self.tp.world} ranks, {self.pipe.runner.cache_cfg.n_heads} of "
                f"{self.pipe.cfg.n_heads} heads per rank, lifecycle check every {self.tp.check_every} steps")

    def run(self, plan):
        """Rank 0: broadcast ``plan`` and execute it; the others (``plan`` None): receive and
        execute. Returns (plan, latent or None)."""
        pipe, tp = self.pipe, self.tp
        try:
            plan = tp.exchange(plan, pipe.lifecycle, self.step_error, offsets_of(pipe))
            self.step_error = None
            try:
                x = pipe.execute(plan)
            except LifecycleError as exc:  # every rank fails together at the next step's vote
                self.step_error, x = str(exc), None
            if plan.event == "stop" or pipe.lifecycle.call_id % tp.check_every == 0:
                n = pipe.cfg.n_layers
                names = [*Lifecycle.SCALAR_NAMES, *(f"offset{i}" for i in range(n))]
                offsets = [pipe.cache.get_offset(i) if pipe.cache is not None else 0 for i in range(n)]
                agreed = tp.check_scalars(names, [*pipe.lifecycle.scalars(), *offsets])
                if plan.event == "stop" and pipe.verbose:
                    pipe.log(f"[owl] tensor parallel: {tp.world} ranks agree at stop: {agreed}")
            return plan, x
        except TPError:
            raise
        except Exception as exc:  # noqa: BLE001 - a collective broke: a peer died or timed out
            if is_collective_error(exc):
                raise tp.explain(exc) from exc
            raise

    def stop(self) -> None:
        """Rank 0: the other ranks stop, after a final vote and lifecycle check."""
        if self.tp.is_leader and self.pipe.lifecycle.phase is not Phase.EMPTY:
            self.run(self.pipe.lifecycle.stop())

    def follow(self) -> int:
        """Ranks other than 0: execute rank 0's steps until it stops; returns frames made."""
        while True:
            plan, _ = self.run(None)
            if plan.event == "stop":
                return self.pipe.lifecycle.frame_index
