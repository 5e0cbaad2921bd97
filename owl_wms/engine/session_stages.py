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
all-gather compares a session's lifecycle scalars at the same steps on every rank. A session
opens on the mesh with its first plan and closes with its stop.

With tensor parallelism inside the mesh (``--pp 2 --tp N``: ranks 1..N split the heads), rank 1
leads it: it checks each message from rank 0 before anything goes to the others, then hands it
on; every mesh rank checks it against its own rows and they vote, with every row's cache offsets,
before any collective of the model; they run it in lockstep and rank 1 answers rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel import ParallelContext, TPError
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
    mesh_links,
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

    @property
    def generating_ranks(self) -> int:
        """The mesh's ranks (more than one: they split the heads)."""
        return self.ctx.world - 1

    def describe(self) -> str:
        mesh, heads = self.generating_ranks, self.sessions.world.model.n_heads
        makers = "rank 1 makes" if mesh == 1 else (f"ranks 1-{mesh} (tensor parallel: each holds {heads // mesh} of "
                                                   f"{heads} heads) make")
        return (f"[owl] two stages: rank 0 plans every session's steps and decodes, {makers} each step's "
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
    """The mesh's side: every session's row, its single steps and the batched ones; with ``tp``
    (this rank's place in a mesh that splits the heads) its leader hands each checked message on
    and the mesh's ranks vote before they run it together."""

    def __init__(self, sessions, ctx: ParallelContext, tp: ParallelContext | None = None):
        self.sessions, self.ctx, self.tp = sessions, ctx, tp
        self.leads = tp is None or tp.is_leader  # the rank that hears from rank 0 and answers it
        self.link, self.others = mesh_links(ctx, tp, slot_bytes(sessions.world.model))
        self.pipes: dict = {}  # row -> this rank's pipeline of the session in it

    def describe(self) -> str:
        return f"[owl] two stages: rank {self.ctx.rank} makes every session's frames for rank 0"

    def follow(self) -> int:
        """Run rank 0's steps until it shuts down; returns the frames made."""
        made = 0
        while True:
            message = self.link.receive(ENVELOPE_TAG, patient=True)
            try:
                plans = self.agree(message)
                if isinstance(message, Shutdown):
                    for link in (self.link, *self.others):
                        link.flush()
                    return made
                answer, done = self.run(message, plans)
            except (LifecycleError, TPError, ValueError) as exc:
                # a vote of the mesh names its ranks already
                text = str(exc) if type(exc) is TPError else f"rank {self.ctx.rank}: {exc}"
                if self.leads:
                    self.link.send_failure(-1, text)
                raise StageError(text) from None
            if self.leads:
                self.link.send(answer, RESULT_TAG)
            for row, plan in done:  # as rank 0 accepts them, in row order
                made += plan.generates
                pipe = self.pipes[row]
                if due_check(plan, self.ctx):
                    compare_scalars(self.ctx, pipe.lifecycle.scalars())
                if plan.event == "stop":
                    self.sessions.close(self.pipes.pop(row))

    def agree(self, message) -> dict:
        """``message``'s plans {row: plan}, checked here; in a split mesh the leader checks them
        before handing the message on, and the mesh's ranks vote before anything runs."""
        if self.tp is None:
            return {} if isinstance(message, Shutdown) else self.plans_of(message)
        error, plans = None, {}
        if self.leads:
            if not isinstance(message, Shutdown):
                plans = self.plans_of(message)  # a refusal goes to rank 0; the others hear of it from the store
            for link in self.others:
                link.send(message, ENVELOPE_TAG)
        elif not isinstance(message, Shutdown):
            try:
                plans = self.plans_of(message)
            except Exception as exc:  # noqa: BLE001 - every mesh rank must reach the vote, which names it
                error = f"rejected the message: {type(exc).__name__}: {exc}"
        self.tp.vote(error, self.offsets())
        return plans

    def offsets(self) -> list[int]:
        """Every row's cache offsets (-1 for a free row): the state digest a split mesh votes with."""
        layers = self.sessions.world.model.n_layers
        return [o for row in range(self.sessions.capacity)
                for o in (offsets_of(self.pipes[row]) if row in self.pipes else [-1] * layers)]

    def plans_of(self, message) -> dict:
        """{row: plan} of a step (each plan checked against its row first) or of one session's cut,
        observed frame or stop."""
        if isinstance(message, StepEnvelope):
            if message.version != STAGE_VERSION or not isinstance(message.plans, dict):
                raise StageError(f"step envelope version {message.version!r}; this build speaks {STAGE_VERSION}")
            plans = {}
            for row in sorted(message.plans):
                plan = check_envelope(Envelope(message.plans[row], row), self.pipe_at(row).lifecycle)
                if not plan.generates:
                    raise StageError(f"a step's {plan.event} plan for row {row} makes no frame")
                plans[row] = plan
            return plans
        row = getattr(message, "session", None)
        return {row: check_envelope(message, self.pipe_at(row).lifecycle)}

    def pipe_at(self, row) -> object:
        """The session in ``row`` (opened by its first plan)."""
        if not isinstance(row, int) or not 0 <= row < self.sessions.capacity:
            raise StageError(f"envelope for session row {row!r}; this mesh has rows 0..{self.sessions.capacity - 1}")
        if row not in self.pipes:
            self.pipes[row] = self.sessions.open(clip=None, row=row)
        return self.pipes[row]

    def run(self, message, plans: dict) -> tuple:
        """Run checked plans: (the answer for rank 0, [(row, plan)] in row order). A step of several
        sessions is one batched call; a split mesh votes again after it, so a step that failed on
        any of its ranks (a wrong count of model calls) ends them all before anyone answers rank 0
        or joins a lifecycle check."""
        out, error = (None, list(plans.items())), None
        try:
            out = self.step(plans) if isinstance(message, StepEnvelope) else self.session_step(*plans.items())
        except LifecycleError as exc:
            if self.tp is None:
                raise
            error = str(exc)
        if self.tp is not None:
            self.tp.vote(error)
        return out

    def session_step(self, item: tuple) -> tuple[Result, list]:
        """A single session's step (its cut, an observed frame, its stop)."""
        row, plan = item
        pipe = self.pipes[row]
        if plan.event == "stop":
            pipe.lifecycle.finish(plan, 0)
            return Result(plan.call_id, plan.epoch, 0, None, offsets_of(pipe)), [item]
        before = self.sessions.runner.calls
        latent = pipe.execute(plan)
        return Result(plan.call_id, plan.epoch, self.sessions.runner.calls - before, latent, offsets_of(pipe)), [item]

    def step(self, plans: dict) -> tuple[StepResult, list]:
        """A step of several sessions: one batched call."""
        by_pipe = {self.pipes[row]: plan for row, plan in plans.items()}
        latents, calls = self.sessions.run(by_pipe)
        # clone: a row of the batch's output would pickle the whole batch with it
        results = {row: Result(plan.call_id, plan.epoch, calls[self.pipes[row]], latents[self.pipes[row]].clone(),
                               offsets_of(self.pipes[row])) for row, plan in plans.items()}
        return StepResult(results), list(plans.items())
