"""H.264 mp4 output (imageio-ffmpeg): checked at start-up, written to a partial file, and
finalised (moov atom written, renamed into place) on every exit, Ctrl-C included."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import imageio_ffmpeg
import numpy as np


class OutputPathError(ValueError):
    pass


def check_output_path(path: str | Path, suffix: str = ".mp4", flag: str = "--out") -> Path:
    path = Path(path)
    if path.suffix.lower() != suffix:
        raise OutputPathError(f"{flag} {str(path)!r} must end in {suffix}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputPathError(f"output folder {str(parent)!r} does not exist; create it or choose another {flag}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputPathError(f"output {str(path)!r} is not writable; choose another {flag}")
    return path


class Mp4Writer:
    """``with Mp4Writer(path, fps) as w: w.write(frame_uint8_hwc)``; ``path`` appears only when
    closed, holding every frame written (none written: no file)."""

    def __init__(self, path: str | Path, fps: float = 30.0, scale: int = 1):
        self.path = check_output_path(path)
        self.partial = self.path.with_name(f".{self.path.stem}.partial.mp4")
        self.fps, self.scale = fps, scale
        self.frames = 0
        self._gen = None
        # Fail now, not after an hour of play, if the folder refuses files.
        try:
            self.partial.touch()
        except OSError as exc:
            raise OutputPathError(f"cannot create {str(self.partial)!r}: {exc}") from exc

    def write(self, frame) -> None:
        frame = np.asarray(frame, dtype=np.uint8)
        if self.scale > 1:
            frame = frame.repeat(self.scale, axis=0).repeat(self.scale, axis=1)
        if self._gen is None:
            h, w = frame.shape[:2]
            self.size = (w, h)
            self._gen = imageio_ffmpeg.write_frames(str(self.partial), (w, h), fps=self.fps, codec="libx264",
                                                    pix_fmt_out="yuv420p", macro_block_size=2,
                                                    output_params=["-crf", "16"])
            self._gen.send(None)
        self._gen.send(np.ascontiguousarray(frame))
        self.frames += 1

    def close(self) -> Path | None:
        if self._gen is not None:
            self._gen.close()  # ffmpeg (shielded from SIGINT by imageio-ffmpeg) writes the index
            self._gen = None
        if self.frames == 0:
            self.partial.unlink(missing_ok=True)
            return None
        os.replace(self.partial, self.path)
        return self.path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def count_frames(path: str | Path) -> int:
    return imageio_ffmpeg.count_frames_and_secs(str(path))[0]


def read_frames(path: str | Path) -> np.ndarray:
    gen = imageio_ffmpeg.read_frames(str(path))
    meta = next(gen)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, dtype=np.uint8).reshape(h, w, 3) for f in gen])


class StopOnSigint:
    """Ctrl-C becomes a request checked between frames (``requested``), so it can never land
    inside a write to ffmpeg and truncate the file; a second Ctrl-C interrupts at once.
    SIGTERM is treated the same way (torchrun turns a Ctrl-C into SIGTERM for its workers)."""

    def __enter__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        self._previous_term = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        signal.signal(signal.SIGTERM, self._previous_term)
