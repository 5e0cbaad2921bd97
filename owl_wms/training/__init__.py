"""Training code for our own world: autoencoder and GameRFT."""
import math


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LR multiplier for LambdaLR: linear warm-up, then cosine decay to 0 at ``total_steps``.

    A plain function of the step, so a resumed run may change ``total_steps``."""
    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, warmup_steps))
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    return factor


def save_training_state(path, step: int, generator, **parts) -> None:
    """Save ``parts`` (modules, optimizers, schedulers: anything with ``state_dict``), the
    step and the data generator's state, so a stopped run resumes where it was."""
    import torch

    torch.save({"step": step, "gen": generator.get_state(),
                **{name: part.state_dict() for name, part in parts.items()}}, path)


def load_training_state(path, generator, **parts) -> int:
    """Restore what ``save_training_state`` wrote (if ``path`` exists); returns the step."""
    import torch
    from pathlib import Path

    if not Path(path).exists():
        return 0
    state = torch.load(path, weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    generator.set_state(state["gen"])
    print(f"resumed at step {int(state['step'])}")
    return int(state["step"])
