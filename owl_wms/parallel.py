"""Tensor parallelism over torch.distributed: attention heads and MLP columns split across ranks.

Megatron-style sharding built on torch.distributed collectives. Rank r keeps the q/k/v rows
of its heads (the qkv weight is laid out (three, heads, dh), so a contiguous split would cut
across q/k/v - we slice per head instead) and a slice of the MLP's hidden units. The two
projections that take sharded inputs (the attention output and the MLP's second layer) come in
two kinds (the tp_reduce setting):

    exact  all-gather the input, compute this rank's slice of the output over the whole input,
           all-gather the output: every value is the single process's to the bit (a matmul's
           output columns do not depend on which others are computed), so a quantized cache
           stores the same codes and TP frames are the single-process frames
    sum    Megatron's row-parallel layer: all-reduce partial sums over input slices (one
           collective instead of two; the sum's order differs from one matmul's, so values move
           by rounding, and a quantized cache can store a neighbouring code)

Each rank's KV cache holds only its heads. Everything else (embeddings, AdaLN, the final layer)
is replicated and computed identically everywhere.

Launch: ``torchrun --nproc-per-node N -m inference.game_cv --headless --tp N``. gloo on CPU,
NCCL on GPU. Rank 0 plans every step and broadcasts it (an ``owl_wms.engine.lifecycle.StepPlan``:
the envelope); every rank validates it before any collective, and the ranks vote, so a bad
envelope fails every rank with the same message instead of hanging a collective. Start-up
compares a digest of settings, model config and weights; every K steps an all-gather compares
lifecycle scalars and cache offsets. A rank that fails writes its error to the rendezvous
store and closes its process group, so its peers stop waiting at once and report that error.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

ERROR_KEY = "owl/tp/error"


class TPError(RuntimeError):
    """Tensor-parallel ranks disagree or one failed; the message names the rank and the cause.
    ``everywhere``: every rank raised it (a vote or a check), so no rank need be told."""

    everywhere = True


def is_collective_error(exc: BaseException) -> bool:
    """A collective broke under us (a peer closed its connection or the timeout passed)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and (
        "gloo" in str(exc) or "NCCL" in str(exc) or "Connection closed" in str(exc)))


def fingerprint(model: nn.Module) -> str:
    """A short digest of the full (unsharded) weights: ranks must load the same checkpoint."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(repr((tuple(p.shape), float(p.double().sum()), float(p.double().abs().sum()))).encode())
    return h.hexdigest()[:16]


def check_heads(cfg: ModelConfig, ranks: int) -> None:
    """The heads split evenly over ``ranks`` (checked alike on every rank, rank 0 of two stages too)."""
    if cfg.n_heads % ranks:
        raise TPError(f"--tp {ranks}: the model has {cfg.n_heads} attention heads, not divisible by "
                      f"{ranks}; use a --tp that divides {cfg.n_heads}")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the input features are split across ranks."""

    def __init__(self, linear: nn.Linear, cols: slice, comm: "ParallelContext"):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone(), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.comm = comm

    def forward(self, x):
        return self.comm.all_reduce(F.linear(x, self.weight)) + self.bias


class GatherParallelLinear(nn.Module):
    """y = all_gather(all_gather(x_shard) @ W_rows^T + b_rows): this rank computes its slice of
    the output features over the whole input, bit for bit the single process's."""

    def __init__(self, linear: nn.Linear, rows: slice, comm: "ParallelContext"):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
        self.comm = comm

    def forward(self, x):
        return self.comm.all_gather(F.linear(self.comm.all_gather(x), self.weight, self.bias))


def _rows(linear: nn.Linear, rows) -> nn.Linear:
    out = nn.Linear(linear.in_features, len(rows), bias=True)
    out.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    out.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    return out


class ParallelContext:
    """This process's place in a tensor-parallel group, and every collective the model uses."""

    def __init__(self, rank: int, world: int, timeout_s: float, check_every: int, reduce_fp32: bool = True,
                 reduce: str = "exact", group=None, first: int = 0):
        """``group``: the process group of these ``world`` ranks (default: the whole job), whose
        rank 0 is the job's rank ``first``; ``rank`` counts within it."""
        if reduce not in ("exact", "sum"):
            raise ValueError(f"tp_reduce {reduce!r} is not one of exact, sum")
        self.rank, self.world, self.timeout_s, self.check_every = rank, world, timeout_s, check_every
        self.group, self.first = group, first
        self.reduce = reduce  # how sharded inputs are combined (module docstring)
        # gloo reduces bf16 element by element (measured 1.7 ms vs 0.7 ms in fp32 for a 64x256
        # activation on this CPU); fp32 also rounds the sum of partials once. NCCL keeps bf16.
        self.reduce_fp32 = reduce_fp32
        # The checks (votes, lifecycle scalars) gather host tensors, which take gloo on GPUs too
        # (launch's "cpu:gloo,cuda:nccl"): no NCCL communicator is made for ranks that only talk,
        # so two stages can share one GPU (NCCL refuses two ranks on one device).
        self.device = torch.device("cpu")
        self.store = dist.distributed_c10d._get_default_store()
        self.collectives = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def job_rank(self, rank: int | None = None) -> int:
        """``rank`` of this group (default: this process's) as the job numbers it (messages name those)."""
        return self.first + (self.rank if rank is None else rank)

    def split(self, first: int) -> "ParallelContext | None":
        """The job's ranks from ``first`` on as a group of their own (the generating mesh beside
        rank 0); every rank must call this (making a group is collective); None where not a member."""
        ranks = list(range(first, self.world))
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
        if self.rank not in ranks:
            return None
        return ParallelContext(self.rank - first, len(ranks), self.timeout_s, self.check_every, self.reduce_fp32,
                               self.reduce, group=group, first=first)

    @classmethod
    def launch(cls, tp: int, device: str, timeout_s: float, check_every: int,
               reduce: str = "exact", flag: str | None = None, app: str = "<app>") -> "ParallelContext":
        """Join the process group torchrun set up; its size must be ``tp`` (``flag``: how the
        app's option asking for that many ranks is spelt, default ``--tp N``; ``app``: the module
        and options the error's example command runs)."""
        flag = flag or f"--tp {tp}"
        if dist.is_initialized():
            raise TPError("torch.distributed is already initialised in this process")
        # On GPUs the model's collectives take NCCL; the stages' messages (host buffers) and the
        # object collectives take gloo beside it.
        cuda = device.startswith("cuda")
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except ValueError as exc:  # env:// without torchrun's variables
            raise TPError(f"{flag} needs {tp} processes started by torchrun: run "
                          f"'torchrun --nproc-per-node {tp} -m {app} {flag} ...' "
                          f"({exc})") from None
        world = dist.get_world_size()
        if world != tp:
            dist.destroy_process_group()
            raise TPError(f"{flag} but torchrun started {world} processes; use --nproc-per-node {tp}")
        if device.startswith("cuda"):
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return cls(dist.get_rank(), world, timeout_s, check_every, reduce_fp32=not cuda, reduce=reduce)

    # -- sharding ------------------------------------------------------------------------------
    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model config one rank's cache sees: its heads only (head_dim unchanged)."""
        return dataclasses.replace(cfg, n_heads=cfg.n_heads // self.world, d_model=cfg.d_model // self.world)

    def check_divisible(self, cfg: ModelConfig):
        check_heads(cfg, self.world)

    @torch.no_grad()
    def shard(self, model: nn.Module) -> nn.Module:
        """Keep this rank's heads and MLP slice in every block (in place)."""
        cfg = model.config
        self.check_divisible(cfg)
        r, n = self.rank, self.world
        for block in model.core.transformer.blocks:
            attn, mlp = block.attn, block.mlp
            h, dh = attn.n_heads, attn.qkv.in_features // attn.n_heads
            hl = h // n
            heads = torch.arange(r * hl, (r + 1) * hl)
            rows = (torch.arange(3)[:, None, None] * h * dh + heads[None, :, None] * dh
                    + torch.arange(dh)[None, None, :]).flatten()  # (three, my heads, dh)
            attn.qkv = _rows(attn.qkv, rows)
            attn.n_heads = hl
            attn.out = self._sharded_input(attn.out, slice(r * hl * dh, (r + 1) * hl * dh))
            hidden = mlp.fc1.out_features
            if hidden % n:
                raise TPError(f"--tp {n}: the MLP's {hidden} hidden units do not split evenly")
            part = slice(r * hidden // n, (r + 1) * hidden // n)
            mlp.fc1 = _rows(mlp.fc1, torch.arange(hidden)[part])
            mlp.fc2 = self._sharded_input(mlp.fc2, part)
        return model

    def _sharded_input(self, linear: nn.Linear, cols: slice) -> nn.Module:
        """``linear`` for an input whose features ``cols`` live on this rank."""
        if self.reduce == "sum":
            return RowParallelLinear(linear, cols, self)
        out = linear.out_features
        if out % self.world:
            raise TPError(f"--tp {self.world}: a projection's {out} outputs do not split evenly; use tp_reduce=sum")
        return GatherParallelLinear(linear, slice(self.rank * out // self.world, (self.rank + 1) * out // self.world),
                                    self)

    # -- collectives ---------------------------------------------------------------------------
    @torch.compiler.disable
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.collectives += 1
        if self.reduce_fp32 and x.dtype != torch.float32:
            y = x.float()
            dist.all_reduce(y, group=self.group)
            return y.to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x

    @torch.compiler.disable
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dim, in rank order."""
        self.collectives += 1
        y = x.float() if self.reduce_fp32 and x.dtype != torch.float32 else x.contiguous()  # lossless
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1).to(x.dtype)

    def agree(self, digest: dict) -> None:
        """Start-up tripwire: every rank's settings, config and weights digest must match rank 0's."""
        gathered = [None] * self.world
        dist.all_gather_object(gathered, digest, group=self.group)
        bad = []
        for r, d in enumerate(gathered):
            diff = sorted(k for k in set(d) | set(gathered[0]) if d.get(k) != gathered[0].get(k))
            if diff:
                bad.append(f"rank {self.job_rank(r)} differs from rank {self.job_rank(0)} in {', '.join(diff)}: "
                           + "; ".join(f"{k}={d.get(k)!r} vs {gathered[0].get(k)!r}" for k in diff))
        if bad:
            raise TPError("tensor-parallel ranks were started with different settings (every rank must run the "
                          "same command and environment): " + " | ".join(bad))

    def vote(self, error: str | None, offsets: list[int] = ()) -> None:
        """Every rank says whether it may proceed, and what its cache holds (``offsets``: tokens a
        layer); if any may not, or the caches differ, all raise the same error."""
        mine = torch.tensor([0 if error is None else 1, *offsets], dtype=torch.float64, device=self.device)
        said = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(said, mine, group=self.group)
        if any(int(s[0]) for s in said):
            errors = [None] * self.world
            dist.all_gather_object(errors, error, group=self.group)
            raise TPError("; ".join(f"rank {self.job_rank(r)}: {e}" for r, e in enumerate(errors) if e))
        for r, theirs in enumerate(said[1:], start=1):
            if not torch.equal(theirs, said[0]):
                held = [sorted({int(v) for v in s[1:] if v >= 0}) for s in (theirs, said[0])]  # -1: a free row
                raise TPError(f"state digest: rank {self.job_rank(r)}'s cache holds {held[0]} tokens a layer, rank "
                              f"{self.job_rank(0)}'s {held[1]} (a cache reset or write on one rank only)")

    def exchange(self, plan, lifecycle, pending_error: str | None, offsets: list[int] = ()):
        """Rank 0 sends its plan (None elsewhere); every rank checks it, then all vote (with what
        their caches hold)."""
        box = [plan if self.is_leader else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        plan = box[0]
        error = pending_error
        if error is None:
            try:
                lifecycle.expect(plan)
            except RuntimeError as exc:
                error = f"rejected the envelope ({plan.summary()}): {exc}"
        self.vote(error, offsets)
        return plan

    def check_scalars(self, names: list[str], values: list[float]) -> str:
        """Periodic tripwire: an all-gather of lifecycle scalars; any difference fails every rank.
        Returns the agreed values as text."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        for r, theirs in enumerate(gathered[1:], start=1):
            if not torch.equal(theirs, gathered[0]):
                diff = [f"{n}={float(a):g} vs {float(b):g}" for n, a, b in zip(names, theirs, gathered[0]) if a != b]
                raise TPError(f"lifecycle check failed: rank {self.job_rank(r)} differs from rank {self.job_rank(0)} "
                              f"in {', '.join(diff)}")
        return " ".join(f"{n}={v:g}" for n, v in zip(names, values))

    # -- failure -------------------------------------------------------------------------------
    def fail(self, exc: BaseException, message: str | None = None) -> None:
        """This rank raised: publish the error (``message``: its text as the app words it) and drop
        out of the group so peers stop waiting."""
        if (isinstance(exc, TPError) and exc.everywhere) or not dist.is_initialized():
            return  # every rank raised it already (a vote or a check)
        try:
            if not self.store.check([ERROR_KEY]):  # the first rank to fail says why; the others were told
                self.store.set(ERROR_KEY, f"rank {self.job_rank()}: {type(exc).__name__}: {message or exc}")
            dist.destroy_process_group()
            time.sleep(1.0)  # let peers read the store before torchrun stops the job
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    def explain(self, exc: BaseException) -> BaseException:
        """A collective failed or timed out here: name the rank that caused it, if one said."""
        if isinstance(exc, TPError):
            return exc
        try:
            self.store.wait([ERROR_KEY], datetime.timedelta(seconds=2))
            cause = self.store.get(ERROR_KEY).decode()
        except Exception:  # noqa: BLE001
            cause = None
        if cause:
            return TPError(f"rank {self.job_rank()} stopped because {cause}")
        err = TPError(f"a collective failed on rank {self.job_rank()} (a peer crashed or exceeded tp_timeout_s="
                      f"{self.timeout_s:g}s): {str(exc).splitlines()[0][:300]}")
        err.params = ("tp_timeout_s",)  # an app may respell it as its own flag
        return err

    def shutdown(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def digest(settings, world, weights: str) -> dict:
    """What every rank must agree on, as comparable strings."""
    # Thread counts may differ by rank (each machine's cores) without changing the numbers.
    s = {f.name: str(getattr(settings, f.name)) for f in dataclasses.fields(settings) if f.name != "threads"}
    return {**{f"settings.{k}": v for k, v in s.items()},
            "model": json.dumps(dataclasses.asdict(world.model), sort_keys=True),
            "pipeline": json.dumps(dataclasses.asdict(world.pipeline), sort_keys=True, default=str),
            "vae_scale": repr(world.vae_scale), "weights": weights}
