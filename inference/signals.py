"""Stop signals in the apps. Until outputs are open, Ctrl-C (SIGINT, SIGTERM, SIGHUP) ends the
process at once, saying nothing was written; once they are open it becomes a request checked
between frames, so every output is finished."""
from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_before_startup: dict | None = None  # the handlers quit_during_startup replaced


def _ours(signum: int, before) -> bool:
    """A SIGHUP the caller ignores (nohup) stays ignored. SIGINT is always ours: a Ctrl-C sent to
    the process group must stop the run even where a shell started it in the background."""
    return signum != signal.SIGHUP or before is not signal.SIG_IGN


def _quit(signum, frame):
    # os._exit, not an exception: torch may be importing (a traceback) or loading on the window's
    # worker thread, and unwinding the interpreter under it aborts the process
    # ("terminate called without an active exception"). Nothing is open yet, so nothing is lost.
    os.write(2, f"\n[owl] interrupted during start-up ({signal.Signals(signum).name}); nothing was written\n".encode())
    os._exit(128 + signum)


def _install(handler) -> dict:
    """``handler`` for the stop signals that are ours; returns the handlers it replaced."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, before in previous.items():
        if _ours(s, before):
            signal.signal(s, handler)
    return previous


def _restore(previous: dict):
    for s, before in previous.items():
        signal.signal(s, before if before is not None else signal.SIG_DFL)


def quit_during_startup():
    """From here until ``StopOnSigint`` is entered, a stop signal ends the process at once."""
    global _before_startup
    if _before_startup is None:
        _before_startup = _install(_quit)


def end_startup():
    """Give the stop signals back their handlers from before ``quit_during_startup``."""
    global _before_startup
    if _before_startup is not None:
        _restore(_before_startup)
        _before_startup = None


class StopOnSigint:
    """Ctrl-C becomes a request checked between frames (``requested``), so it can never land
    inside a write to ffmpeg and truncate the file; a second Ctrl-C interrupts at once.
    SIGTERM and SIGHUP are treated the same way (torchrun turns a Ctrl-C into SIGTERM for its
    workers; a closed terminal sends SIGHUP). Entering it ends the start-up's quick exit."""

    def __enter__(self):
        end_startup()
        self.requested = False
        self.signum = signal.SIGINT  # the first stop signal (a second Ctrl-C's KeyboardInterrupt is SIGINT's)
        self._previous = _install(self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    @property
    def exit_code(self) -> int:
        """The exit status of a run this signal stopped, as the shell's for it: 128 + its number
        (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
        return 128 + self.signum

    def __exit__(self, *exc):
        _restore(self._previous)
