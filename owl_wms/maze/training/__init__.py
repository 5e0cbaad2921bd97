"""Training code for our own world: autoencoder and GameRFT."""
import math
import time

# A checkpoint's record of its world model's training (scripts.train_world's metrics, written
# by scripts.export_checkpoint), so a fine-tune of it can say in MODEL.md how it was made.
WORLD_RECORD = "world_training.json"
# the world model train_world builds unless --config names another (its record then names it)
DEFAULT_WORLD_CONFIG = "configs/maze_world.yaml"


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LR multiplier for LambdaLR: linear warm-up, then cosine decay to 0 at ``total_steps``.

    A plain function of the step, so a resumed run may change ``total_steps``."""
    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, warmup_steps))
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    return factor


class RunLog:
    """Wall time of a resumable stage over all its invocations: one record per run (from_step,
    to_step reached, batch, target: the run's --steps, options: its other recipe flags if any,
    seconds). It is saved with the training state, so a run stopped between saves still counts
    up to its last save (the next run redoes, and times, the steps after it)."""

    def __init__(self, runs: list[dict], step: int, batch: int, target: int, options: str = ""):
        self.done, self.t0 = [dict(r) for r in runs], time.time()
        self.now = {"from_step": step, "batch": batch, "target": target}
        if options:  # recipe flags beyond --batch/--steps, as typed (MODEL.md repeats them)
            self.now["options"] = options

    def runs(self, step: int) -> list[dict]:
        """Every run so far, this one up to ``step``."""
        return self.done + [{**self.now, "to_step": step, "seconds": time.time() - self.t0}]

    def record(self, step: int) -> dict:
        """What a stage's metrics file says about its time."""
        runs = self.runs(step)
        return {"seconds_this_run": runs[-1]["seconds"], "seconds_all_runs": sum(r["seconds"] for r in runs),
                "runs": runs}


def file_stage_clock(previous: dict, total: int, todo: int):
    """Timer of a stage that makes one file per item (generate_data, encode_latents), given its
    earlier record, how many files it makes in all and how many this run still has to make.
    Returns a function that gives the record's time fields: a rerun that found every file
    already made keeps the earlier runs' times, rather than recording the 0 s it took, so
    MODEL.md still states what the stage costs; a resumed run adds its own time to theirs."""
    clock = RunLog(previous.get("runs", []), total - todo, 1, total)

    def record() -> dict:
        if not todo and "seconds_this_run" in previous:
            return {k: previous[k] for k in ("seconds_this_run", "seconds_all_runs", "runs") if k in previous}
        return clock.record(total)
    return record


def save_training_state(path, step: int, generator, runs: list[dict], **parts) -> None:
    """Save ``parts`` (modules, optimizers, schedulers: anything with ``state_dict``), the
    step, the data generator's state, torch's global generator (noise drawn without a
    generator) and the ``RunLog`` records, so a stopped run resumes exactly where it was."""
    import os

    import torch

    tmp = f"{path}.tmp"  # written whole, then renamed: a run killed mid-save keeps the last state
    torch.save({"step": step, "gen": generator.get_state(), "torch_rng": torch.get_rng_state(), "runs": runs,
                **{name: part.state_dict() for name, part in parts.items()}}, tmp)
    os.replace(tmp, path)


def load_training_state(path, generator, **parts) -> tuple[int, list[dict] | None]:
    """Restore what ``save_training_state`` wrote (if ``path`` exists): (the step, its run
    records; None from a state saved before they were kept)."""
    import torch
    from pathlib import Path

    if not Path(path).exists():
        return 0, []
    state = torch.load(path, weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    generator.set_state(state["gen"])
    if "torch_rng" in state:  # saved since stopped runs resume exactly
        torch.set_rng_state(state["torch_rng"])
    print(f"resumed at step {int(state['step'])}")
    return int(state["step"]), state.get("runs")


# exit status of a training stage stopped by SIGINT/SIGTERM after saving its state (EX_TEMPFAIL: run it again)
STOPPED = 75


class StopSignal:
    """While active, SIGINT and SIGTERM only set ``requested``: a training loop finishes the step it
    is in, saves its state there and exits, so the next run resumes at exactly that step (a chain
    stopped at its time budget loses nothing). A second signal stops at once."""

    def __init__(self):
        self.requested = False
        self._before = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        return False
