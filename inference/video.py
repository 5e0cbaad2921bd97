"""H.264 mp4 output (imageio-ffmpeg): checked at start-up, written to a partial file, and
finalised (moov atom written, renamed into place) on every exit, Ctrl-C included."""
from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import imageio_ffmpeg
import numpy as np


MIN_FREE = 1 << 20  # bytes a recording of unknown length needs at start-up; a full disk is caught at close too
# Bytes per output pixel of our H.264 (CRF 16): the shipped world's rollouts measured 0.025-0.04
# at --scale 4 and 0.09 at --scale 1 (upscaled pixels cost less); 0.15 leaves room for busier
# worlds (tests/test_headless.py checks the estimate covers real rollouts).
MP4_BYTES_PER_PIXEL = 0.15
MP4_OVERHEAD = 4096  # the container's header and index
_PARTIALS = itertools.count()


class OutputPathError(ValueError):
    """An output path is refused before any work (its flag, the path and the fix are named)."""


class OutputWriteError(RuntimeError):
    """Writing an output failed (a full disk, ffmpeg stopped); the message says what was kept."""


def check_output_path(path: str | Path, suffix: str = ".mp4", flag: str = "--out", need: int = 0) -> Path:
    """``path`` as a new output: its suffix, an existing writable folder, not a folder itself,
    and ``need`` bytes free there."""
    if not str(path).strip():
        raise OutputPathError(f"{flag} is empty; give a file name ending in {suffix}, e.g. 'out{suffix}'")
    path = Path(path)
    if path.is_dir():  # (before the suffix: a folder is the mistake to name, whatever its name)
        raise OutputPathError(f"{flag} {str(path)!r} is a folder; give a file name, e.g. {str(path / ('out' + suffix))!r}")
    if path.suffix.lower() != suffix:
        raise OutputPathError(f"{flag} {str(path)!r} must end in {suffix}")
    parent = path.parent
    if not parent.is_dir():
        raise OutputPathError(f"output folder {str(parent)!r} does not exist; create it or choose another {flag}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputPathError(f"output {str(path)!r} is not writable; choose another {flag}")
    # Fail now, not after an hour of play, if the folder refuses the file (a name too long, say).
    partial = partial_path(path)
    try:
        partial.touch()
        partial.unlink()
    except OSError as exc:
        raise OutputPathError(f"{flag} {str(path)!r}: cannot create {str(partial)!r} ({exc.strerror or exc}); "
                              f"choose another {flag}") from None
    if need:
        require_space([(flag, path, need)])
    return path


def partial_path(path: Path) -> Path:
    """A hidden file for an output to be written to before it is renamed into place, new at
    each call: two writers of the same output (two runs, or two in one process) never touch each
    other's, and the last to finish is the file left."""
    return path.with_name(f".{path.stem}.{os.getpid()}-{next(_PARTIALS)}.partial{path.suffix}")


def failure_hint(path: Path) -> str:
    """Why writing beside ``path`` most likely failed, for a message."""
    try:
        full = shutil.disk_usage(path.parent).free < MIN_FREE
    except OSError:
        full = False
    return "the disk is full" if full else "the encoder stopped"


def remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def mp4_bytes(frames: int, height: int, width: int) -> int:
    """An estimate of an H.264 video's size, ``frames`` of ``height`` x ``width`` output pixels."""
    return int(frames * height * width * MP4_BYTES_PER_PIXEL) + MP4_OVERHEAD


def size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{-(-n // 1024)} KiB"


def require_space(outputs: list[tuple[str, Path, int]]):
    """Refuse outputs ``(flag, path, estimated bytes)`` whose folder's disk has less free space
    than everything written to that disk needs."""
    disks: dict[int, tuple[Path, list]] = {}
    for flag, path, need in outputs:
        disks.setdefault(os.stat(path.parent).st_dev, (path.parent, []))[1].append((flag, path, need))
    for parent, items in disks.values():
        free, need = shutil.disk_usage(parent).free, sum(n for *_, n in items)
        if free < need:
            what = ", ".join(f"{flag} {str(path)!r}" for flag, path, _ in items)
            raise OutputPathError(f"{what} needs about {size_text(need)} but only {size_text(free)} is free in "
                                  f"{str(parent)!r}; free some space, write elsewhere, or render fewer frames or a "
                                  "smaller --scale")


class Mp4Writer:
    """``with Mp4Writer(path, fps) as w: w.write(frame_uint8_hwc)``; ``path`` appears only when
    closed, holding every frame written (none written: no file)."""

    def __init__(self, path: str | Path, fps: float = 30.0, scale: int = 1, flag: str = "--out", need: int = 0):
        # (the partial file is made by the first frame: a run stopped during start-up leaves nothing)
        self.path = check_output_path(path, flag=flag, need=need)
        self.partial = partial_path(self.path)
        self.fps, self.scale = fps, scale
        self.frames, self.failed = 0, False
        self._gen = None

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
        try:
            self._gen.send(np.ascontiguousarray(frame))
        except OSError as exc:  # ffmpeg stopped: a full disk, most often
            self._gen, self.failed = None, True
            remove_quietly(self.partial)
            raise OutputWriteError(f"writing {str(self.path)!r} failed after {self.frames} frames "
                                   f"({failure_hint(self.path)}); nothing was kept: {str(exc).splitlines()[0]}") from None
        self.frames += 1

    def close(self) -> Path | None:
        """Finish the video and move it into place; None if no frame was written (no file)."""
        if self._gen is not None:
            self._gen.close()  # ffmpeg (shielded from SIGINT by imageio-ffmpeg) writes the index
            self._gen = None
        if self.frames == 0 or self.failed:
            remove_quietly(self.partial)
            return None
        if not finished_mp4(self.partial):
            remove_quietly(self.partial)
            self.failed = True  # closing again returns None instead of raising again
            raise OutputWriteError(f"ffmpeg could not finish {str(self.path)!r} ({self.frames} frames; "
                                   f"{failure_hint(self.path)}); nothing was kept")
        os.replace(self.partial, self.path)
        return self.path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def flat_frame_warning(frame) -> str | None:
    """A one-line warning when a decoded frame is one flat colour (all black, say): the output
    is certainly wrong, and the likely causes are named."""
    frame = np.asarray(frame)
    lo, hi = int(frame.min()), int(frame.max())
    if hi - lo > 2:
        return None
    return (f"[owl] warning: the first frame is one flat colour (pixel values {lo} to {hi}); this checkpoint's "
            "weights, its decoder or its train.vae_scale are likely wrong")


def write_atomically(path: Path, write) -> Path:
    """``write(tmp)`` to a hidden file beside ``path``, renamed into place only when it succeeded;
    on failure nothing is left and OutputWriteError says so."""
    tmp = partial_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise OutputWriteError(f"writing {str(path)!r} failed ({exc.strerror or exc}); nothing was kept") from None
    return path


def finished_mp4(path: Path) -> bool:
    """The file is a whole mp4: its top-level boxes (4-byte size, 4-byte type) tile the file
    exactly, and one of them is the index (``moov``) that ffmpeg writes after the frames."""
    try:
        size = path.stat().st_size
        seen, at = set(), 0
        with open(path, "rb") as f:
            while at < size:
                f.seek(at)
                head = f.read(16)
                if len(head) < 8:
                    return False
                length, kind = int.from_bytes(head[:4], "big"), head[4:8]
                if length == 1:  # a 64-bit size follows
                    length = int.from_bytes(head[8:16], "big")
                elif length == 0:  # to the end of the file
                    length = size - at
                if length < 8 or at + length > size:
                    return False
                seen.add(kind)
                at += length
        return b"moov" in seen
    except OSError:
        return False


def count_frames(path: str | Path) -> int:
    return imageio_ffmpeg.count_frames_and_secs(str(path))[0]


def read_frames(path: str | Path) -> np.ndarray:
    gen = imageio_ffmpeg.read_frames(str(path))
    meta = next(gen)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, dtype=np.uint8).reshape(h, w, 3) for f in gen])


