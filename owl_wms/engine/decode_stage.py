"""The decoder beside the generator: frames are decoded on a thread of their own while the
next frame is generated, through a bounded queue.

    stage = DecodeStage(lambda latent: pipe.decode(latent).numpy(), threads=1)
    for controls in script:
        stage.submit(pipe.generate(*controls), tag=i)   # waits while `depth` latents wait
        for tag, frame in stage.ready():                # frames decoded so far, in order
            show(frame)
    for tag, frame in stage.drain(): show(frame)        # the last ones
    stage.close()

The decode runs the same kernels on the same latents as the synchronous call, so frames and
their order are unchanged; only when each is shown moves (by at most ``depth`` + 1 frames).
On the CPU the thread runs torch with its own thread count, so the two stages split the cores;
on a GPU it decodes on a CUDA stream of its own, after the generator's work on the latent.
Every frame carries a tag (the caller's: a frame index, a cache epoch); ``discard`` drops
the frames in flight (a hard cut in a live game: the old world's frames are never shown) and
counts them.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterator

import torch

_STOP = object()


class DecodeStage:
    def __init__(self, decode: Callable[[torch.Tensor], Any], threads: int | None = 1, depth: int = 1,
                 name: str = "owl-decode"):
        """``decode``: latent -> frame, run on the stage's thread; ``threads``: torch's thread
        count there (None: leave it); ``depth``: latents that may wait behind the one decoding."""
        if depth < 1:
            raise ValueError(f"decode depth {depth} must be at least 1")
        self.decode, self.threads = decode, threads
        self.waiting: queue.Queue = queue.Queue(maxsize=depth)  # back-pressure: submit waits when full
        self.done: queue.Queue = queue.Queue()  # bounded by depth + 1 in flight, taken in order
        self.in_flight = 0  # submitted, not yet taken out (the submitter's count)
        self.discarded = 0  # frames dropped by discard()
        self.generation = 0  # bumped by discard(): frames of an older one are dropped
        self.error: BaseException | None = None
        self.seconds = 0.0  # time the thread spent decoding
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import time

        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread's OpenMP team, not the generator's
        while (item := self.waiting.get()) is not _STOP:
            generation, tag, latent, ready = item
            try:
                start = time.perf_counter()
                with torch.no_grad(), (torch.cuda.stream(self.stream) if ready is not None
                                       else contextlib.nullcontext()):
                    if ready is not None:  # the generator's kernels that made the latent come first
                        self.stream.wait_event(ready)
                        latent.record_stream(self.stream)
                    frame = self.decode(latent)
                    if ready is not None:
                        self.stream.synchronize()
                self.seconds += time.perf_counter() - start
                self.done.put((generation, tag, frame, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the submitter, raised there
                self.done.put((generation, tag, None, exc))

    def submit(self, latent, tag: Any = None) -> None:
        """Queue ``latent`` (what ``decode`` takes) for decoding; waits while the queue is full
        (the decoder is behind)."""
        self._raise()
        ready = None
        if isinstance(latent, torch.Tensor) and latent.is_cuda and self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        self.in_flight += 1
        self.waiting.put((self.generation, tag, latent, ready))

    def _take(self, block: bool) -> tuple[Any, Any] | None:
        while self.in_flight:
            try:
                generation, tag, frame, exc = self.done.get(block=block)
            except queue.Empty:
                return None
            self.in_flight -= 1
            if exc is not None:
                self.error = exc
                self._raise()
            if generation == self.generation:
                return tag, frame
            self.discarded += 1  # submitted before a discard: never shown
        return None

    def ready(self) -> Iterator[tuple[Any, Any]]:
        """(tag, frame) of every frame decoded so far, in submission order, without waiting."""
        while (item := self._take(block=False)) is not None:
            yield item

    def next(self) -> tuple[Any, Any] | None:
        """The next (tag, frame), waiting for its decode; None when nothing is in flight."""
        return self._take(block=True)

    def drain(self) -> Iterator[tuple[Any, Any]]:
        """Every frame still in flight, in order, waiting for each."""
        while (item := self._take(block=True)) is not None:
            yield item

    def discard(self) -> None:
        """Frames submitted so far will not be shown (a hard cut while playing): they are dropped
        as they come out, and counted in ``discarded``."""
        self.generation += 1

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"decoding a frame failed: {self.error}") from self.error

    def close(self) -> None:
        """Stop the thread after the frames in flight (their frames are not kept)."""
        if self.thread.is_alive():
            self.waiting.put(_STOP)
            self.thread.join()
        self.discarded += self.in_flight
        self.in_flight = 0
