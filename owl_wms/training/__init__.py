"""Training code for our own world: autoencoder and GameRFT."""
import math


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LR multiplier for LambdaLR: linear warm-up, then cosine decay to 0 at ``total_steps``.

    A plain function of the step, so a resumed run may change ``total_steps``."""
    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, warmup_steps))
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    return factor
