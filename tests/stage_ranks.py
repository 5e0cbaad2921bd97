"""Two-stage ranks for tests/test_stages.py: each a process on gloo over 127.0.0.1 running a
scenario, faults injected on one rank by wrapping its pipeline's methods here (the product has
no test hooks). Each rank reports (rank, outcome, message, data) on a queue, handling errors as
the apps do: the failing rank tells its peer through the rendezvous store, and a rank whose
receive broke reports the cause its peer gave."""
import datetime
import os
import time
import traceback

FRAMES = 12


def script(frames: int = FRAMES):
    import torch

    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float()) for _ in range(frames)]


def settings(**changes):
    import torch

    from owl_wms.settings import KVSettings, Settings

    base = Settings(device="cpu", dtype=torch.float32, attn_backend="sdpa", attn_backend_decode="sdpa",
                    kv_recompute_every=5, kv_recompute_anchor="decoded",
                    kv=KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="int8"))
    return base.replace(**changes)


def events(pipe, f: int, bias: bool = True):
    """A bias change at frame 3, a hard cut back to the clip at frame 7 (recomputes every 5)."""
    if f == 3 and bias:
        pipe.kv_cache_attention_bias = -0.5
    if f == 7:
        pipe.restart_from_buffer()


def alone(checkpoint, bias: bool = True) -> list:
    """The frames of one process, as decoded uint8 arrays."""
    from owl_wms.engine import CausvidPipeline

    pipe = CausvidPipeline.from_checkpoint(checkpoint, settings=settings(), verbose=False)
    out = []
    for f, controls in enumerate(script()):
        events(pipe, f, bias)
        out.append(pipe.decode(pipe.generate(*controls)).numpy())
    return out


def run_rank(rank: int, world: int, port: int, queue, body, timeout_s: float = 60) -> None:
    """Join the gloo group as ``rank`` and report (rank, outcome, message, data) of ``body(ctx)``
    on ``queue``, as the apps report it: a rank that fails tells its peers through the store; one
    whose receive broke reports the cause its peer gave."""
    import torch
    import torch.distributed as dist

    from owl_wms.parallel import ParallelContext, is_collective_error

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    ctx = ParallelContext(rank, world, timeout_s=timeout_s, check_every=4)  # a hang is the test's limit to catch
    try:
        queue.put((rank, "ok", "", body(ctx)))
    except Exception as exc:  # noqa: BLE001 - reported as the apps report it
        if is_collective_error(exc):
            message = str(ctx.explain(exc))
        else:
            ctx.fail(exc)
            message = f"{type(exc).__name__}: {exc}"
        queue.put((rank, "error", message, traceback.format_exc()[-1500:]))
    finally:
        queue.close()
        queue.join_thread()  # the report is out before the process ends
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def rank_main(rank: int, port: int, checkpoint: str, scenario: str, queue, world: int = 2) -> None:
    """``world`` 3: ranks 1 and 2 generate, the heads split between them (``--pp 2 --tp 2``)."""

    def body(ctx):
        from owl_wms.engine import CausvidPipeline

        mesh = ctx.split(1) if world > 2 else None
        mine = settings(kv_recompute_every=4) if scenario == "plan_mismatch" and rank == world - 1 else settings()
        pipe = CausvidPipeline.from_checkpoint(checkpoint, settings=mine, pp=ctx, tp=mesh, verbose=False)
        if rank > 0:
            inject_mesh(pipe, scenario, rank)
            return pipe.stages.follow()
        return drive(pipe, scenario)

    run_rank(rank, world, port, queue, body, timeout_s=2 if scenario == "idle" else 60)


def inject_mesh(pipe, scenario: str, rank: int) -> None:
    """The mesh's faults: on its leader (rank 1); for ``reset_follower`` on rank 2 (the mesh's
    other rank); an extra model call on every mesh rank (the generator's code is the same on each:
    one rank alone calling the model would leave its collectives unanswered)."""
    if scenario != "extra_call" and (rank == 2) != (scenario == "reset_follower"):
        return
    execute, runner = pipe.execute, pipe.runner
    count = {"frames": 0}

    def counted(plan):
        out = execute(plan)
        count["frames"] += plan.generates
        if scenario in ("reset_one_side", "reset_follower") and count["frames"] == 4:
            pipe.cache.reset()  # the mesh's cache restarts; rank 0 was not told
        if scenario == "drift" and count["frames"] == 2:
            pipe.lifecycle.since_anchor += 1  # the recompute window's start drifts by a frame here only
        return out

    def delayed(plan):
        if plan.generates and count["frames"] == 6:
            time.sleep(1.0)  # this result arrives after rank 0 cut to a new history
        return counted(plan)

    pipe.execute = delayed if scenario == "late_result" else counted
    if scenario == "extra_call":
        denoise = runner.denoise

        def one_more(x, mouse, buttons, cache, *rest, **kwargs):
            import torch

            out = denoise(x, mouse, buttons, cache, *rest, **kwargs)
            t = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
            runner.call(x, t, mouse, buttons, cache, 0.0, False)  # a model call the plan does not have
            return out

        runner.denoise = one_more


def drive(pipe, scenario: str):
    """Rank 0: the script's frames through the stages, decoded; what the scenario needs back."""
    from owl_wms.engine.lifecycle import StepPlan

    if scenario == "recompute_without_frames":
        plan_frame = pipe.plan_frame

        def no_context(*args, **kwargs):
            plan: StepPlan = plan_frame(*args, **kwargs)
            if plan.event == "recompute":
                plan.history = plan.history_mouse = plan.history_buttons = None
            return plan

        pipe.plan_frame = no_context
    stages, shown, cut_at = pipe.stages, [], None
    for f, controls in enumerate(script()):
        if scenario == "idle" and f == 5:
            shown += [(n, pipe.decode(x).numpy()) for n, x in stages.drain()]
            time.sleep(3)  # a paused game: longer than tp_timeout_s (2 s here) without a step
        if scenario == "late_result" and f == 7:
            cut_at = len(shown)
            pipe.restart_from_buffer()  # a live cut: the frames in flight are not taken first
        elif scenario != "late_result":
            if f in (3, 7):
                shown += [(n, pipe.decode(x).numpy()) for n, x in stages.drain()]  # a script takes them first
            events(pipe, f)
        shown += [(n, pipe.decode(x).numpy()) for n, x in stages.request(*controls, tag=f)]
    shown += [(n, pipe.decode(x).numpy()) for n, x in stages.drain()]
    pipe.close()
    return {"shown": shown, "dropped": stages.dropped, "cut_at": cut_at}


def sessions_script(sessions, steps: int = 9):
    """Three sessions over the rows of one ring: two from the start, the first leaves at step 4
    and a new one takes its row, the second restarts at step 6. Returns each session's latents
    by (seed, step) and the sessions still open."""
    import torch

    g = torch.Generator().manual_seed(5)
    pipes = {seed: sessions.open(seed=seed) for seed in (1, 2)}
    out = {}
    for step in range(steps):
        if step == 4:
            sessions.close(pipes.pop(1))
            sessions.close(sessions.open(seed=9, clip=None))  # a page that left before its history (row 0)
            pipes[3] = sessions.open(seed=3)
        if step == 6:
            pipes[2].restart_from_buffer()
        controls = {p: (torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float()) for p in pipes.values()}
        latents = sessions.step(controls)
        out.update({(seed, step): latents[p].clone() for seed, p in pipes.items()})
    return out, pipes


def sessions_alone(checkpoint) -> dict:
    from owl_wms.engine.sessions import Sessions

    sessions = Sessions.from_checkpoint(checkpoint, settings=settings(kv_recompute_every=3), capacity=2, verbose=False)
    return sessions_script(sessions)[0]


def sessions_rank_main(rank: int, port: int, checkpoint: str, scenario: str, queue, world: int = 2) -> None:
    """Two stages of several sessions (``inference.serve --pp 2``): rank 0 runs ``sessions_script``;
    ``world`` 3: ranks 1 and 2 split the heads (``--pp 2 --tp 2``)."""

    def body(ctx):
        from owl_wms.engine.sessions import Sessions

        mesh = ctx.split(1) if world > 2 else None
        sessions = Sessions.from_checkpoint(checkpoint, settings=settings(kv_recompute_every=3), capacity=2,
                                            verbose=False, pp=ctx, tp=mesh)
        if rank > 0:
            run = sessions.run
            if scenario == "sessions_extra_call" and rank == 1:
                def one_more(plans):
                    latents, calls = run(plans)
                    return latents, {p: c + (sessions.runner.calls > 12) for p, c in calls.items()}

                sessions.run = one_more  # a step reports a model call more than its plans have
            if scenario == "sessions_reset_follower" and rank == 2:
                steps = []

                def reset_after_three(plans):
                    out = run(plans)
                    steps.append(1)
                    if len(steps) == 3:
                        next(iter(plans)).cache.reset()  # one session's row restarts on this rank only
                    return out

                sessions.run = reset_after_three
            if scenario == "sessions_follower_fails" and rank == 2:
                from owl_wms.engine.lifecycle import LifecycleError

                steps = []

                def last_step_fails(plans):
                    out = run(plans)
                    steps.append(1)
                    if len(steps) == 9:  # the script's last step made its frames, then failed here only
                        raise LifecycleError("injected: this rank's step failed after its model calls")
                    return out

                sessions.run = last_step_fails
            return sessions.follow()
        made, _ = sessions_script(sessions)
        sessions.shut_down()
        return {key: latent.numpy() for key, latent in made.items()}  # tensors would share memory across the queue

    run_rank(rank, world, port, queue, body)
