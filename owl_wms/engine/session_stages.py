"""Two pipeline stages for a batch of sessions (``inference.serve --pp 2``): rank 0 serves the
pages, plans every session's steps and decodes; the mesh (rank 1) holds every session's cache
row and makes each step's frames in one batched call.

    rank 0 (Sessions: plans, decoding)                  rank 1 (Sessions: the model and the ring)
    a session's cut or stop: Envelope(plan, row)  --->  that row's pipeline runs it (stages.py)
    a step: StepEnvelope({row: plan})             --->  Sessions.run: one batched call a denoising step
    <--- Result, or StepResult({row: Result}): latents, model calls, each row's cache offsets
    Shutdown                                      --->  the mesh stops

Each session keeps the lifecycle contract of stages.py: rank 0 checks each plan before anything
goes out; the mesh checks it against that row's own lifecycle before anything runs; each row's
model calls and cache offsets come back and are checked against rank 0's count; the periodic
all-gather compares a session's lifecycle scalars at the same steps on both ranks. A session
opens on the mesh with its first plan and closes with its stop.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel import ParallelContext
from .lifecycle import LifecycleError, StepPlan
from .stages import (
    ENVELOPE_TAG,
    MESH,
    RESULT_TAG,
    STAGE_VERSION,
    Envelope,
    FirstStage,
    Result,
    StageError,
    StageLink,
    check_envelope,
    check_plan,
    compare_scalars,
    mesh_answer,
    offsets_of,
    slot_bytes,
)


@dataclass
class StepEnvelope:
    """One step of several sessions: each row's frame plan."""
    plans: dict  # row -> StepPlan
    version: int = STAGE_VERSION


@dataclass
class StepResult:
    results: dict  # row -> Result
    version: int = STAGE_VERSION


@dataclass
class Shutdown:
    version: int = STAGE_VERSION


def due_check(plan: StepPlan, ctx: ParallelContext) -> bool:
    """Whether both ranks compare this session's lifecycle scalars after ``plan`` (as FirstStage.check)."""
    return plan.event == "stop" or (plan.call_id + 1) % ctx.check_every == 0


class SessionsFirstStage:
    """Rank 0's side: one link to the mesh, shared by every session's own ``FirstStage``."""

    def __init__(self, sessions, ctx: ParallelContext):
        self.sessions, self.ctx = sessions, ctx
        self.link = StageLink(ctx, MESH, slot_bytes(sessions.world.model), depth=2)

    def describe(self) -> str:
        return (f"[owl] two stages: rank 0 plans every session's steps and decodes, rank 1 makes each step's "
                f"frames in one batched call; lifecycle check every {self.ctx.check_every} steps")

    def attach(self, pipe, row: int) -> FirstStage:
        """The session in ``row``'s own stage: its cuts and its stop go over the shared link."""
        return FirstStage(pipe, self.ctx, session=row, link=self.link)

    def step(self, plans: dict) -> dict:
        """{pipe: latent} of one step's {pipe: frame plan}, in row order, made by the mesh."""
        rows = self.sessions.rows
        for pipe, plan in plans.items():  # before any header goes out
            if not plan.generates:
                raise StageError(f"rank 0: a step's {plan.event} plan (call {plan.call_id}) makes no frame")
            check_plan(plan, pipe.lifecycle)
        self.link.send(StepEnvelope({rows[p]: plan for p, plan in plans.items()}), ENVELOPE_TAG)
        scalars = {}
        for pipe, plan in plans.items():
            pipe.lifecycle.advance(plan)
            scalars[pipe] = pipe.lifecycle.scalars()
        asked = sorted(rows[p] for p in plans)
        answer = mesh_answer(self.link.receive(RESULT_TAG), StepResult, f"a step of rows {asked}")
        if sorted(answer.results or {}) != asked:
            raise StageError(f"rank 0: the mesh answered a step of rows {asked} with rows {sorted(answer.results or {})}")
        return {pipe: pipe.stages.accept(plan, answer.results[rows[pipe]], scalars[pipe]) for pipe, plan in plans.items()}

    def stop(self) -> None:
        """The mesh stops (after every session's own stop)."""
        self.link.send(Shutdown(), ENVELOPE_TAG)
        self.link.flush()


class SessionsMesh:
    """The mesh's side: every session's row, its single steps and the batched ones."""

    def __init__(self, sessions, ctx: ParallelContext):
        self.sessions, self.ctx = sessions, ctx
        self.link = StageLink(ctx, 0, slot_bytes(sessions.world.model), depth=4)
        self.pipes: dict = {}  # row -> this rank's pipeline of the session in it

    def describe(self) -> str:
        return f"[owl] two stages: rank {self.ctx.rank} makes every session's frames for rank 0"

    def follow(self) -> int:
        """Run rank 0's steps until it shuts down; returns the frames made."""
        made = 0
        while True:
            message = self.link.receive(ENVELOPE_TAG, patient=True)
            if isinstance(message, Shutdown):
                self.link.flush()
                return made
            try:
                answer, done = self.step(message) if isinstance(message, StepEnvelope) else self.session_step(message)
            except (LifecycleError, StageError, ValueError) as exc:
                text = f"rank {self.ctx.rank}: {exc}"
                self.link.send_failure(-1, text)
                raise StageError(text) from None
            self.link.send(answer, RESULT_TAG)
            for row, plan in done:  # as rank 0 accepts them, in row order
                made += plan.generates
                pipe = self.pipes[row]
                if due_check(plan, self.ctx):
                    compare_scalars(self.ctx, pipe.lifecycle.scalars())
                if plan.event == "stop":
                    self.sessions.close(self.pipes.pop(row))

    def pipe_at(self, row) -> object:
        """The session in ``row`` (opened by its first plan)."""
        if not isinstance(row, int) or not 0 <= row < self.sessions.capacity:
            raise StageError(f"envelope for session row {row!r}; this mesh has rows 0..{self.sessions.capacity - 1}")
        if row not in self.pipes:
            self.pipes[row] = self.sessions.open(clip=None, row=row)
        return self.pipes[row]

    def session_step(self, envelope) -> tuple[Result, list]:
        """A single session's step (its cut, an observed frame, its stop)."""
        pipe = self.pipe_at(getattr(envelope, "session", None))
        plan = check_envelope(envelope, pipe.lifecycle)
        if plan.event == "stop":
            pipe.lifecycle.finish(plan, 0)
            return Result(plan.call_id, plan.epoch, 0, None, offsets_of(pipe)), [(envelope.session, plan)]
        before = self.sessions.runner.calls
        latent = pipe.execute(plan)
        return (Result(plan.call_id, plan.epoch, self.sessions.runner.calls - before, latent, offsets_of(pipe)),
                [(envelope.session, plan)])

    def step(self, message: StepEnvelope) -> tuple[StepResult, list]:
        """A step of several sessions, each plan checked against its row first; one batched call."""
        if message.version != STAGE_VERSION or not isinstance(message.plans, dict):
            raise StageError(f"step envelope version {message.version!r}; this build speaks {STAGE_VERSION}")
        plans, rows = {}, {}
        for row in sorted(message.plans):
            pipe = self.pipe_at(row)
            plan = check_envelope(Envelope(message.plans[row], row), pipe.lifecycle)
            if not plan.generates:
                raise StageError(f"a step's {plan.event} plan for row {row} makes no frame")
            plans[pipe], rows[pipe] = plan, row
        latents, calls = self.sessions.run(plans)
        # clone: a row of the batch's output would pickle the whole batch with it
        results = {rows[p]: Result(plan.call_id, plan.epoch, calls[p], latents[p].clone(), offsets_of(p))
                   for p, plan in plans.items()}
        return StepResult(results), [(rows[p], plan) for p, plan in plans.items()]
