"""Initial clips: a history window of VAE latents with its controls, plus future actions.

File format (safetensors): ``latents [n, c, h, w]`` raw VAE latents (not divided by
vae_scale), ``mouse [n, 2]`` and ``buttons [n, 11]`` for every frame; metadata
``history_frames`` says how many leading frames form the history. The remaining controls
(and latents, when present) are the recorded future used by ground-truth replay. A clip
rendered from a simulator level also records it (metadata ``level``: JSON with the level
``seed`` and the ``simulator`` options), so the simulator can replay the history and play on
beside the model (``owl_wms.maze.evaluation.replay_clip``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .controls import N_BUTTONS


@dataclass
class Clip:
    latents: torch.Tensor  # [n_hist(+future), c, h, w]
    mouse: torch.Tensor  # [n, 2]
    buttons: torch.Tensor  # [n, 11]
    history_frames: int
    name: str = "clip"
    level: dict | None = None  # {"seed": level seed, "simulator": SimConfig options} when rendered from one

    @property
    def future_mouse(self):
        return self.mouse[self.history_frames:]

    @property
    def future_buttons(self):
        return self.buttons[self.history_frames:]

    @property
    def future_frames(self) -> int:
        """How many frames of recorded actions follow the history (what ground truth can replay)."""
        return self.mouse.shape[0] - self.history_frames

    def history(self, window: int):
        """The last ``window`` history frames: (latents, mouse, buttons)."""
        if self.history_frames < window:
            raise ValueError(f"clip {self.name!r} has {self.history_frames} history frames; "
                             f"the pipeline window needs {window}")
        s = slice(self.history_frames - window, self.history_frames)
        return self.latents[s], self.mouse[s], self.buttons[s]

    def save(self, path: str | Path):
        save_file({"latents": self.latents.contiguous().float(), "mouse": self.mouse.contiguous().float(),
                   "buttons": self.buttons.contiguous().float()}, str(path),
                  metadata={"history_frames": str(self.history_frames),
                            **({"level": json.dumps(self.level)} if self.level is not None else {})})


def load_clip(path: str | Path, channels: int, sample_size: int) -> Clip:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"clip {str(path)!r} is a folder; give a clip .safetensors file or a clip index")
    if not path.is_file():
        raise FileNotFoundError(f"clip file {str(path)!r} does not exist; give a clip .safetensors file or a "
                                "clip index (0, 1, ...)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"clip {str(path)!r} is not a readable safetensors file ({str(exc)[:120]}); a clip holds "
                         "latents, mouse and buttons") from None
    missing = {"latents", "mouse", "buttons"} - tensors.keys()
    if missing or "history_frames" not in meta:
        raise ValueError(f"clip {str(path)!r} lacks {sorted(missing) or 'metadata history_frames'}")
    lat, mouse, buttons = tensors["latents"], tensors["mouse"], tensors["buttons"]
    if lat.ndim != 4 or tuple(lat.shape[1:]) != (channels, sample_size, sample_size):
        raise ValueError(f"clip {str(path)!r} latents have shape {tuple(lat.shape)}; the model expects "
                         f"[n, {channels}, {sample_size}, {sample_size}]")
    n = mouse.shape[0]
    if mouse.shape != (n, 2) or buttons.shape != (n, N_BUTTONS) or lat.shape[0] > n:
        raise ValueError(f"clip {str(path)!r}: mouse {tuple(mouse.shape)} / buttons {tuple(buttons.shape)} "
                         f"must be [n, 2] / [n, 11] with n >= {lat.shape[0]} latent frames")
    level = None
    if "level" in meta:
        try:
            level = json.loads(meta["level"])
            int(level["seed"]), dict(level["simulator"])
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"clip {str(path)!r}: metadata level {meta['level']!r} is not "
                             f'{{"seed": N, "simulator": {{...}}}} ({exc})') from exc
    return Clip(lat.float(), mouse.float(), buttons.float(), int(meta["history_frames"]), path.stem, level)


def list_clips(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def world_clips(world) -> list[Path]:
    """A world's clips in index order (its config's ``pipeline.clips`` folder; none: [])."""
    folder = world.resolve(world.pipeline.clips)
    return list_clips(folder) if folder is not None and folder.is_dir() else []


def is_clip_index(text: str) -> bool:
    """``text`` names a clip by its index (ASCII digits), not by a path."""
    return text.isascii() and text.isdigit()


def clip_path(world, index: int) -> Path:
    """The file of the world's clip ``index``, or an error that says which indices there are."""
    paths = world_clips(world)
    if not paths:
        raise FileNotFoundError(f"world {world.name!r} has no clips (pipeline.clips={world.pipeline.clips!r}); "
                                "start from a simulator level or a clip file instead")
    if not 0 <= index < len(paths):
        raise ValueError(f"clip {index} does not exist: world {world.name!r} has {len(paths)} clips "
                         f"(0 to {len(paths) - 1})")
    return paths[index]


def check_clip(world, clip: str) -> None:
    """A start given as text, a clip index or a clip file, is one of the world's clips or a
    file that loads for its model; raises with the fix otherwise (before any weights load)."""
    if is_clip_index(clip):
        clip_path(world, int(clip))
    else:
        load_clip(clip, world.model.channels, world.model.sample_size)
