"""Two pipeline stages over torch.distributed: rank 0 owns the controls, the plans, decoding and
output; rank 1 (the mesh) owns the generator and its KV cache. Frames flow between them as
versioned messages, so rank 0 decodes frame n while the mesh makes frame n + 1.

    rank 0                                              rank 1 (the mesh)
    plan n+1 -> check -> Envelope ---------------->     check (version, lifecycle) -> execute
    Result n <------------------------------------      latent, model calls, cache offsets
    count, check, decode beside (DecodeStage)

The lifecycle contract (docs/pipeline_parallel.md):
- every message is checked by its sender before anything goes out (``check_plan``) and by the
  mesh before it runs; an unknown version is refused before any collective;
- a recompute carries its context frames from rank 0 (what the player saw, or the latents rank 0
  kept); the mesh never rebuilds from anything else;
- the mesh counts its model calls; a count other than the envelope's fails both ranks;
- each result carries the mesh's cache offsets, checked against what rank 0's lifecycle says the
  cache holds (a cache reset on one side only is found at the next frame), and every
  ``check_every`` results both ranks all-gather their lifecycle scalars;
- a hard cut bumps the epoch; a live game sends it at once and the frames still in flight are
  dropped as they arrive (the old world is never shown after a restart), and counted; a script
  takes them first (``FirstStage.drain``);
- a snapshot is taken between frames: rank 0 keeps its parts (noise, lifecycle, anchor, replay)
  and asks the mesh for its cache (``CacheState``); a restore sends the cache and the lifecycle
  back, so both stages resume from the same step.

Messages are pickled objects (the job's own processes: TP's envelope travels the same way),
sent with non-blocking sends so neither side waits on the other's receive; one frame is in
flight beside the one being decoded (``FirstStage.depth``).
"""
from __future__ import annotations

import collections
import pickle
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..parallel import ERROR_KEY, ParallelContext, TPError
from .lifecycle import Lifecycle, LifecycleError, Phase, StepPlan

STAGE_VERSION = 1
ENVELOPE_TAG, RESULT_TAG = 11, 12
MESH = 1  # the mesh's leader


class StageError(TPError):
    """The stages disagree or one failed; the message names the rank and the cause. Raised on
    one rank: the app tells the other (``ParallelContext.fail``)."""

    everywhere = False


@dataclass
class Envelope:
    """What rank 0 sends for a step: the plan (call id, frame index, epoch, reset flag, context
    frames, denoising steps as expected calls, bias, controls, noise) and the session."""
    plan: StepPlan
    session: int = 0
    version: int = STAGE_VERSION


@dataclass
class CacheState:
    """A snapshot's part that lives on the mesh, between the frames (none in flight): ``"save"``
    asks for the cache's state; ``"load"`` brings one (``tensors``, ``meta``) with the
    lifecycle's state to resume from (snapshot.py)."""
    op: str
    tensors: dict | None = None
    meta: dict | None = None
    lifecycle: dict | None = None
    version: int = STAGE_VERSION


@dataclass
class Result:
    """What the mesh sends back: the step's latent (if it makes a frame), its model calls and
    the cache as it left it; or the error that stopped the mesh. For a ``CacheState`` "save":
    the cache's (tensors, meta) in ``state``."""
    call_id: int
    epoch: int
    calls: int = 0
    latent: torch.Tensor | None = None
    offsets: list = field(default_factory=list)
    error: str | None = None
    state: tuple | None = None
    version: int = STAGE_VERSION


def slot_bytes(cfg) -> int:
    """A message buffer that holds a frame's envelope (its noise) or result (its latent), as
    float32, with room for the rest: the same on both ranks (the config is checked alike)."""
    return 8192 + 2 * 4 * cfg.channels * cfg.sample_size * cfg.sample_size


def check_plan(plan: StepPlan, lifecycle: Lifecycle) -> None:
    """The sender's check, before any header goes out."""
    if plan.reset and plan.history is None:
        raise StageError(f"rank 0: the {plan.event} envelope (call {plan.call_id}) carries no context frames; a reset of the "
                         "mesh's cache must bring the frames it rebuilds from (the mesh never falls back to others)")
    if plan.history is not None and (plan.history_mouse is None or plan.history_buttons is None
                                     or plan.history_mouse.shape[0] != plan.history.shape[0]):
        raise StageError(f"rank 0: the {plan.event} envelope (call {plan.call_id}) has {plan.history.shape[0]} "
                         "context frames but not their controls")
    if plan.generates and (plan.mouse is None or plan.buttons is None):
        raise StageError(f"rank 0: the frame envelope (call {plan.call_id}) has noise but no controls")
    want = lifecycle.calls_for(plan.event)
    if want is None or plan.expected_calls != want:
        raise StageError(f"rank 0: the {plan.event!r} envelope (call {plan.call_id}) expects {plan.expected_calls} "
                         f"model calls; a {plan.event} makes {want}")


class StageLink:
    """Messages between rank 0 and the mesh: pickled, sent without waiting for the receiver,
    at most ``depth`` sends outstanding. A message goes as one ``slot``-byte buffer (its length,
    then the bytes) when it fits, which a frame's envelope and result do; a longer one (a new
    history) says its length in the slot and follows in a second send. (Each gloo message costs
    a wake-up on both sides, about 0.7 ms on a 2-core VM: one a message where possible.)"""

    HEADER = 8

    def __init__(self, ctx: ParallelContext, peer: int, slot: int, depth: int = 2):
        self.ctx, self.peer, self.slot, self.depth = ctx, peer, slot, depth
        self.sending: collections.deque = collections.deque()  # (work, buffer) of sends in flight

    def send(self, obj, tag: int) -> None:
        data = pickle.dumps(obj)
        first = torch.zeros(self.slot, dtype=torch.uint8)
        first[:self.HEADER] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        rest = None
        if len(data) <= self.slot - self.HEADER:
            first[self.HEADER:self.HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            rest = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for buffer in (first, rest):
            if buffer is None:
                continue
            while len(self.sending) >= self.depth:  # back-pressure: the peer is behind
                self.sending.popleft()[0].wait()
            self.sending.append((dist.isend(buffer, self.peer, tag=tag), buffer))

    def receive(self, tag: int, patient: bool = False):
        """The next message; ``patient``: no deadline for its first part (the mesh waiting for
        rank 0's next step: a paused game or an idle server sends nothing for as long as it likes)."""
        first = torch.empty(self.slot, dtype=torch.uint8)
        self.wait(dist.irecv(first, self.peer, tag=tag), patient)
        n = int(first[:self.HEADER].view(torch.int64))
        if n <= self.slot - self.HEADER:
            return pickle.loads(first[self.HEADER:self.HEADER + n].numpy().tobytes())
        data = torch.empty(n, dtype=torch.uint8)
        self.wait(dist.irecv(data, self.peer, tag=tag))
        return pickle.loads(data.numpy().tobytes())

    def wait(self, work, patient: bool = False) -> None:
        """Wait for a receive (on a helper thread: gloo's receive has no poll), looking at the
        rendezvous store every 50 ms: a peer that failed says why there
        (``ParallelContext.fail``), and this rank stops with its words, never a hang (a peer that
        died outright closes its connection, which ends the receive)."""
        errors: list = []

        def wait():
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - raised on the caller's thread
                errors.append(exc)

        waiter = threading.Thread(target=wait, name="owl-stage-receive", daemon=True)
        waiter.start()
        deadline = time.monotonic() + self.ctx.timeout_s
        while waiter.is_alive():
            waiter.join(0.05)
            if not waiter.is_alive():
                break
            if self.ctx.store.check([ERROR_KEY]):
                raise StageError(f"rank {self.ctx.rank} stopped because {self.ctx.store.get(ERROR_KEY).decode()}")
            if not patient and time.monotonic() > deadline:
                raise StageError(f"rank {self.ctx.rank}: nothing came from rank {self.peer} in tp_timeout_s="
                                 f"{self.ctx.timeout_s:g} s (it stopped or is stuck)")
        if errors:
            raise errors[0]

    def flush(self) -> None:
        while self.sending:
            self.sending.popleft()[0].wait()

    def send_failure(self, call_id: int, text: str) -> None:
        """The mesh tells rank 0 why it stops (if rank 0 is still there: it may have found the fault too)."""
        try:
            self.send(Result(call_id, -1, error=text), RESULT_TAG)
            self.flush()
        except Exception:  # noqa: BLE001 - rank 0 stopped first
            pass


def mesh_answer(answer, kind: type, asked: str):
    """The mesh's ``answer`` to what rank 0 ``asked``, checked to be a ``kind`` of this build's
    version: a refusal (an answer carrying an error) or anything else ends the run, saying what came."""
    if getattr(answer, "error", None) is not None:
        raise StageError(f"rank {MESH} stopped: {answer.error}")
    if not isinstance(answer, kind) or answer.version != STAGE_VERSION:
        raise StageError(f"rank 0: the mesh answered {asked} with {type(answer).__name__} version "
                         f"{getattr(answer, 'version', None)!r}; this build speaks {STAGE_VERSION}")
    return answer


_OWN = object()  # the tag of a step the pipeline waits for (a cut, an observed frame, the stop)


class FirstStage:
    """Rank 0's side: plans go to the mesh, results come back in order and are checked; the
    caller decodes the frames. A caller that takes the frames in flight (``drain``) before a
    hard cut shows every frame (a script); one that does not (a game) never sees the frames made
    before the cut: they are dropped by epoch as they arrive, and counted in ``dropped``."""

    def __init__(self, pipe, ctx: ParallelContext, depth: int = 1, session: int = 0, link: StageLink | None = None):
        """``depth``: frames in flight beside the one just sent (one keeps rank 1 busy: the next
        envelope is there before it finishes a frame); ``session``, ``link``: one of several
        sessions sharing a link to the mesh (session_stages.py)."""
        self.pipe, self.ctx, self.depth, self.session, self.shared = pipe, ctx, depth, session, link is not None
        self.link = link or StageLink(ctx, MESH, slot_bytes(pipe.cfg), depth=2 * (depth + 1))
        self.pending: collections.deque = collections.deque()  # (plan, tag, lifecycle scalars after it)
        self.ready: list = []  # (tag, latent) that arrived while a step waited for its own result
        self.dropped = 0

    def describe(self) -> str:
        mesh = self.ctx.world - 1
        ranks = "rank 1 generates" if mesh == 1 else (f"ranks 1-{mesh} generate (tensor parallel: each holds "
                                                      f"{self.pipe.cfg.n_heads // mesh} of {self.pipe.cfg.n_heads} heads)")
        return (f"[owl] two stages: rank 0 plans and decodes, {ranks}; {self.depth} frame in flight beside the one "
                f"decoding, lifecycle check every {self.ctx.check_every} steps")

    def run(self, plan: StepPlan):
        """The pipeline's step on rank 0: send ``plan`` and wait for its own result."""
        self.send(plan, _OWN)
        latent = None
        while self.pending:
            tag, x = self.receive()
            if tag is _OWN:
                latent = x
            elif x is not None:
                self.ready.append((tag, x))
        return plan, latent

    def request(self, mouse, buttons, tag=None) -> list:
        """Plan this frame and send it; returns [(tag, latent)] of the frames that came back
        meanwhile, in order. A due recompute first takes every frame in flight (its anchor)."""
        out, self.ready = self.ready, []
        if self.pipe.lifecycle.recompute_due:
            out += self.drain()
        self.send(self.pipe.plan_frame(mouse, buttons), tag)
        while len(self.pending) > self.depth:
            tag, x = self.receive()
            if x is not None:
                out.append((tag, x))
        return out

    def drain(self) -> list:
        """Every frame still in flight, in order."""
        out, self.ready = self.ready, []
        while self.pending:
            tag, x = self.receive()
            if x is not None:
                out.append((tag, x))
        return out

    def send(self, plan: StepPlan, tag) -> None:
        check_plan(plan, self.pipe.lifecycle)  # before any header goes out
        self.link.send(Envelope(plan, self.session), ENVELOPE_TAG)
        self.pipe.lifecycle.advance(plan)
        self.pending.append((plan, tag, self.pipe.lifecycle.scalars()))

    def receive(self):
        """The next result, checked: (tag, latent), latent None for a step without a frame or a
        frame of an older epoch (dropped)."""
        plan, tag, scalars = self.pending.popleft()
        return tag, self.accept(plan, self.link.receive(RESULT_TAG), scalars)

    def accept(self, plan: StepPlan, result, scalars: list):
        """``plan``'s result, checked: its latent, or None for a step without a frame or a frame
        of an older epoch (dropped). ``scalars``: the lifecycle's just after ``plan``."""
        result = mesh_answer(result, Result, f"call {plan.call_id}")
        if result.call_id != plan.call_id or result.epoch != plan.epoch:
            raise StageError(f"rank 0: the result of call {result.call_id} (epoch {result.epoch}) arrived; call "
                             f"{plan.call_id} (epoch {plan.epoch}) was next")
        self.check(plan, result, scalars)
        if not plan.generates:
            return None
        if plan.epoch < self.pipe.lifecycle.epoch:  # made before a hard cut: never shown
            self.dropped += 1
            return None
        if plan.commit:
            self.pipe.planner.recompute_anchor.add(result.latent[0, 0], plan.mouse, plan.buttons)
        return result.latent

    def check(self, plan: StepPlan, result: Result, scalars: list) -> None:
        life = self.pipe.lifecycle
        life.model_calls += result.calls
        if result.calls != plan.expected_calls:
            raise StageError(f"rank {MESH} made {result.calls} model calls in step {plan.summary()}; the envelope "
                             f"expected {plan.expected_calls}")
        want = scalars[Lifecycle.SCALAR_NAMES.index("cached_frames")] * self.pipe.cfg.tokens_per_frame
        if any(o != want for o in result.offsets):
            raise StageError(f"state digest: after call {plan.call_id} ({plan.event}) the mesh's cache holds "
                             f"{sorted(set(result.offsets))} tokens a layer; rank 0's lifecycle says {want} "
                             "(a cache reset or write on one side only)")
        if plan.event == "stop" or (plan.call_id + 1) % self.ctx.check_every == 0:
            scalars = list(scalars)
            scalars[Lifecycle.SCALAR_NAMES.index("model_calls")] = life.model_calls
            compare_scalars(self.ctx, scalars)

    # -- snapshots: the cache is the mesh's --------------------------------------------------------
    def cache_state(self) -> tuple[dict, dict]:
        """The mesh cache's (tensors, meta), for a snapshot taken between frames."""
        return self.exchange_state(CacheState("save")).state

    def load_cache_state(self, tensors: dict, meta: dict, lifecycle: dict) -> None:
        """The mesh's cache and lifecycle become a snapshot's (rank 0 restores its own parts)."""
        self.exchange_state(CacheState("load", tensors, meta, lifecycle))

    def exchange_state(self, message: CacheState) -> Result:
        if self.shared:
            raise RuntimeError("snapshots of a session that shares the generating rank with others (the server's "
                               "two stages) are not supported")
        if self.ctx.world > 2:
            raise RuntimeError(f"snapshots of a two-stage run whose generating ranks split the heads (--tp "
                               f"{self.ctx.world - 1}) are not supported (each holds only its heads); drop --tp")
        if self.pending or self.ready:
            raise RuntimeError(f"a snapshot with {len(self.pending) + len(self.ready)} frames in flight; take them "
                               "first (FirstStage.drain): a snapshot is taken between frames")
        self.link.send(message, ENVELOPE_TAG)
        return mesh_answer(self.link.receive(RESULT_TAG), Result, f"a cache {message.op}")

    def stop(self) -> None:
        """The mesh stops, after the frames in flight (dropped: the caller took what it wanted);
        a session sharing the link that never had a history sent nothing, so it sends no stop."""
        if self.shared and self.pipe.lifecycle.phase is Phase.EMPTY and not self.pending:
            return
        self.drain()
        self.run(self.pipe.lifecycle.stop())
        self.link.flush()


def compare_scalars(ctx: ParallelContext, values: list) -> None:
    """The periodic all-gather of both stages' lifecycle scalars."""
    try:
        ctx.check_scalars(list(Lifecycle.SCALAR_NAMES), values)
    except TPError as exc:
        raise StageError(f"periodic lifecycle check: {exc}") from None


class Mesh:
    """The mesh's side: its leader (rank 1) receives envelopes, checks them, runs them and
    answers; with tensor parallelism inside the mesh (``pipe.tp``) the leader's check comes
    before the plan goes to the other mesh ranks, and they run it in lockstep
    (tensor_parallel.py)."""

    def __init__(self, pipe, ctx: ParallelContext):
        self.pipe, self.ctx = pipe, ctx
        self.link, self.others = mesh_links(ctx, pipe.tp.tp if pipe.tp is not None else None, slot_bytes(pipe.cfg))

    def describe(self) -> str:
        return f"[owl] two stages: rank {self.ctx.rank} generates for rank 0"

    def follow(self) -> int:
        """Run rank 0's steps until it stops; returns the frames made."""
        pipe, made = self.pipe, 0
        if pipe.tp is not None and not pipe.tp.is_leader:
            return self.follow_leader()
        while True:
            envelope = self.link.receive(ENVELOPE_TAG, patient=True)
            if isinstance(envelope, CacheState):
                self.link.send(self.serve_state(envelope), RESULT_TAG)
                continue
            try:
                plan = self.check(envelope)
                before = pipe.runner.calls
                latent = self.execute(plan)
                calls = pipe.runner.calls - before
            except (LifecycleError, TPError) as exc:
                # a vote of the mesh names its ranks already
                text = str(exc) if type(exc) is TPError else f"rank {self.ctx.rank}: {exc}"
                self.link.send_failure(getattr(getattr(envelope, "plan", None), "call_id", -1), text)
                raise StageError(text) from None
            made += plan.generates
            self.link.send(Result(plan.call_id, plan.epoch, calls, latent, offsets_of(pipe)), RESULT_TAG)
            if plan.event == "stop" or (plan.call_id + 1) % self.ctx.check_every == 0:
                compare_scalars(self.ctx, pipe.lifecycle.scalars())  # as rank 0's, when the result arrives
            if plan.event == "stop":
                for link in (self.link, *self.others):
                    link.flush()
                return made

    def serve_state(self, message: CacheState) -> Result:
        """Rank 0's snapshot request between frames; a refused one leaves the cache as it was."""
        pipe, life = self.pipe, self.pipe.lifecycle
        try:
            if message.version != STAGE_VERSION or message.op not in ("save", "load"):
                raise ValueError(f"cache state message {message.op!r} version {message.version!r}; this build speaks "
                                 f"save/load version {STAGE_VERSION}")
            if pipe.tp is not None:
                raise ValueError("the generating ranks split the heads: snapshots are not supported")
            if message.op == "save":
                return Result(life.call_id, life.epoch, state=pipe.cache.state_dict())
            # copies: the cache's state is its live tensors, which a load refused part way has written
            tensors, meta = pipe.cache.state_dict()
            before = {name: t.clone() for name, t in tensors.items()}, meta, life.state()
            try:
                pipe.cache.load_state_dict(message.tensors, message.meta)
                life.load_state(message.lifecycle)
            except Exception:
                pipe.cache.load_state_dict(before[0], before[1])
                life.load_state(before[2])
                raise
            return Result(life.call_id, life.epoch)
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as exc:
            return Result(life.call_id, life.epoch, error=f"rank {self.ctx.rank}: cache {message.op}: {exc}")

    def execute(self, plan: StepPlan):
        """Run a checked plan here, or with the other mesh ranks."""
        if self.pipe.tp is not None:
            for link in self.others:  # the mesh's other ranks wait for this without a deadline
                link.send(plan.call_id, ENVELOPE_TAG)
            return self.pipe.tp.run(plan)[1]
        if plan.event == "stop":
            self.pipe.lifecycle.finish(plan, 0)
            return None
        return self.pipe.execute(plan)

    def follow_leader(self) -> int:
        """A mesh rank other than its leader: the leader's plans, in lockstep, and the stages'
        lifecycle checks at the same steps as every other rank."""
        pipe, made = self.pipe, 0
        while True:
            self.link.receive(ENVELOPE_TAG, patient=True)  # the leader's word that a step follows
            plan, _ = pipe.tp.run(None)
            made += plan.generates
            if plan.event == "stop" or (plan.call_id + 1) % self.ctx.check_every == 0:
                compare_scalars(self.ctx, pipe.lifecycle.scalars())
            if plan.event == "stop":
                return made

    def check(self, envelope) -> StepPlan:
        return check_envelope(envelope, self.pipe.lifecycle)


def mesh_links(ctx: ParallelContext, tp: ParallelContext | None, slot: int) -> tuple[StageLink, list]:
    """A mesh rank's links: the one it hears from (rank 0 for the mesh's leader, the leader for
    its other ranks, who wait on it without a deadline: a paused game or an idle server sends
    nothing for as long as it likes, and a collective would give up after tp_timeout_s), and the
    leader's links to those other ranks."""
    leads = tp is None or tp.is_leader
    link = StageLink(ctx, 0 if leads else MESH, slot, depth=4)
    return link, [StageLink(ctx, tp.job_rank(r), slot, depth=4) for r in range(1, tp.world)] if tp is not None and leads else []


def check_envelope(envelope, lifecycle: Lifecycle) -> StepPlan:
    """The mesh's check before anything runs: the version, then the plan against ``lifecycle``."""
    version = getattr(envelope, "version", None)
    if not isinstance(envelope, Envelope) or version != STAGE_VERSION:
        raise StageError(f"envelope version {version!r} ({type(envelope).__name__}); this build speaks "
                         f"{STAGE_VERSION}")
    plan = envelope.plan
    if plan.reset and plan.history is None:
        raise StageError(f"the {plan.event} envelope (call {plan.call_id}) carries no context frames; the mesh "
                         "rebuilds its cache only from the frames rank 0 sends")
    lifecycle.expect(plan)
    return plan


def offsets_of(pipe) -> list[int]:
    """What a pipeline's cache holds, tokens a layer (the state digest each result carries)."""
    return [pipe.cache.get_offset(i) for i in range(pipe.cfg.n_layers)] if hasattr(pipe.cache, "get_offset") else []
