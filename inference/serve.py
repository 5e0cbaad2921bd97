"""Play the world model in a browser: one server, every player's session in one batched call.

    python -m inference.serve                        # then open the printed URL
    python -m inference.serve --host 0.0.0.0 --port 8000 --max-sessions 4
    torchrun --nproc-per-node 2 -m inference.serve --pp 2   # rank 0 serves and decodes, rank 1 generates
    torchrun --nproc-per-node 3 -m inference.serve --pp 2 --tp 2   # ranks 1 and 2 split the heads

The page, the protocol, admission and scaling out behind nginx: docs/serve.md.
"""
from __future__ import annotations

import argparse
import faulthandler
import ipaddress
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

if __name__ == "__main__":  # first of all, before torch loads (seconds): say so; a Ctrl-C now ends quietly
    from inference.signals import quit_during_startup

    quit_during_startup()
    from inference.cores import same_numbers_at_any_thread_count
    from inference.heap import keep_freed_memory

    same_numbers_at_any_thread_count()
    keep_freed_memory()
    if not {"-h", "--help"} & set(sys.argv):
        print("[owl] starting ...", flush=True)

from owl_wms.config import ConfigError  # noqa: E402
from owl_wms.engine.sessions import Sessions, batch_rows  # noqa: E402
from owl_wms.loading import CheckpointError  # noqa: E402
from owl_wms.maze.worlds import check_simulator  # noqa: E402
from owl_wms.parallel import ParallelContext, TPError, check_heads, is_collective_error  # noqa: E402
from owl_wms.settings import SettingsError  # noqa: E402

from .cli import ArgumentParser  # noqa: E402
from .flags import flag_message, warnings_as_lines  # noqa: E402
from .signals import end_startup  # noqa: E402
from .game_cv import (  # noqa: E402
    add_world_arguments,
    check_world_arguments,
    compile_in_background,
    keep_graphs_between_starts,
    processes,
    run_settings,
)
from .video import OutputPathError  # noqa: E402
from .web.app import Limits, create_app, host_name, page_socket_protocol  # noqa: E402
from .web.protocol import MAX_LEVEL, MAX_MESSAGE_BYTES, MAX_SEED  # noqa: E402
from .web.scheduler import Scheduler, ServeOptions  # noqa: E402

SERVE_FREE_BELOW = 0.7  # a core counts as free while other processes use at most 70% of it (CoreBudget)

USER_ERRORS = (ConfigError, CheckpointError, SettingsError, OutputPathError, FileNotFoundError, ValueError, OSError,
               TPError)


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m inference.serve", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_world_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="NAME",
                   help="a host name whose pages may play besides the server's own (a proxy's public name; repeatable)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, printed)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="players served at once (default: measured at start-up against --target-fps)")
    p.add_argument("--session-limit", type=int, default=8, help="most players the measured capacity may reach")
    p.add_argument("--target-fps", type=float, default=10.0, help="each player's frame rate the capacity keeps")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds without input before a session closes")
    p.add_argument("--clip", default="0", help="where a session starts: a shipped clip's index or a clip file")
    p.add_argument("--world-seed", type=int, default=None, help="or a simulator level (a page's hello may pick one)")
    p.add_argument("--seed", type=int, default=None, help="noise seed of the first session (session i: seed + i)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of the frames sent")
    p.add_argument("--max-fps", type=float, default=None, help="steps a second at most (default: as fast as it goes)")
    p.add_argument("--record-dir", default=None,
                   help="folder for the pages' recordings (default: a temporary folder, removed at exit)")
    p.add_argument("--save-actions", default=None,
                   help="folder for each session's action file and start (to re-render it headless)")
    p.add_argument("--one-by-one", action="store_true",
                   help="step each session with its own model calls, one after another (the baseline batching beats)")
    p.add_argument("--pp", type=int, default=1, choices=(1, 2),
                   help="2: two pipeline stages, rank 0 serving the pages and decoding while rank 1 makes every "
                        "step's frames (launch with torchrun --nproc-per-node 2, or N+1 with --tp N)")
    p.add_argument("--tp", type=int, default=1,
                   help="with --pp 2: ranks 1..N make the frames, each holding 1/N of the heads (launch with "
                        "torchrun --nproc-per-node N+1)")
    args = p.parse_args(argv)
    check_world_arguments(p, args)
    if not 1 <= args.tp <= 64:
        p.error(f"--tp {args.tp}: must be a whole number in [1, 64]")
    if args.tp > 1 and args.pp != 2:
        p.error(f"--tp {args.tp} splits the heads of the generating stage: add --pp 2 and launch "
                f"'torchrun --nproc-per-node {args.tp + 1} -m inference.serve --pp 2 --tp {args.tp}'")
    if args.pp == 2 and args.one_by_one:
        p.error("--one-by-one steps each session in this process; with --pp 2 rank 1 makes every step in one batched "
                "call: drop one of them")
    # (64 rows: start-up times a step at every padded batch size up to the limit, each with its own cache)
    for flag, value, lo, hi in (("--port", args.port, 0, 65535), ("--max-sessions", args.max_sessions, 1, 64),
                                ("--session-limit", args.session_limit, 1, 64), ("--quality", args.quality, 1, 95),
                                ("--world-seed", args.world_seed, 0, MAX_LEVEL), ("--seed", args.seed, 0, MAX_SEED)):
        if value is not None and not lo <= value <= hi:
            p.error(f"{flag} {value}: must be a whole number in [{lo}, {hi}]")
    for flag, value, lo in (("--target-fps", args.target_fps, 0), ("--idle-timeout", args.idle_timeout, 1),
                            ("--max-fps", args.max_fps, 0)):
        if value is not None and not (0 < value <= 100_000 and value >= lo):
            p.error(f"{flag} {value}: must be a positive number" + (f" of at least {lo}" if lo else ""))
    names = [host_name(v) if v.strip() else None for v in args.allow_origin]
    for value, name in zip(args.allow_origin, names):
        if not name:
            p.error(f"--allow-origin {value!r}: give a host name, e.g. play.example.org")
    args.allow_origin = names
    for flag, value in (("--record-dir", args.record_dir), ("--save-actions", args.save_actions)):
        if value is not None and (problem := folder_problem(Path(value))):
            p.error(f"{flag} {value!r}: {problem}; choose another folder")
    return args


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be written into ``folder`` (made on first use, so it may not exist yet), or None."""
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == folder else f"cannot be made: {str(existing)!r} is not writable"
    return None


def is_loopback(sock: socket.socket) -> bool:
    try:
        return ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port fails at once."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle off only on sockets that say so (proto 0 kept it on,
        # and with a page's delayed ACKs frames measured arriving three at a time, 45 ms apart)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
        return sock
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port "
                      "(or --port 0 for any free one) or --host") from None


def clip_arg(value: str):
    return int(value) if value.isdigit() else value


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings_as_lines()
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        try:  # kill -USR1 <pid>: every thread's stack, on the terminal
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, OSError):  # no terminal to write to
            pass
    keep_graphs_between_starts()
    temporary = ctx = None
    try:
        # Threads not chosen by hand follow the cores other processes leave free, as the window's
        # do (a thread per core beside a busy neighbour collapses the frame rate), but a core counts
        # as taken only when others use most of it: the players' own pages beside the server do not.
        world, settings, budget = run_settings(args, free_below=SERVE_FREE_BELOW)
        if args.pp == 2:
            ctx = ParallelContext.launch(processes(args), settings.device, settings.tp_timeout_s,
                                         settings.tp_check_every, settings.tp_reduce,
                                         flag="--pp 2" + (f" --tp {args.tp}" if args.tp > 1 else ""), app="inference.serve")
            check_heads(world.model, args.tp)  # on every rank: rank 0 would not hear of a refusal inside the mesh
            mesh = ctx.split(1) if args.tp > 1 else None  # the generating ranks' own group (None on rank 0)
            if not ctx.is_leader:
                return generate(args, world, settings, ctx, mesh)
        sock = listen(args.host, args.port)
        check_simulator(world)
        options = ServeOptions(max_sessions=args.max_sessions, session_limit=args.max_sessions or args.session_limit,
                               target_fps=args.target_fps, batched=not args.one_by_one, clip=clip_arg(args.clip),
                               world_seed=args.world_seed, quality=args.quality, max_fps=args.max_fps,
                               record_dir=Path(args.record_dir or "recordings"),
                               save_actions=Path(args.save_actions) if args.save_actions else None)
        limit = options.session_limit
        print(f"[owl] loading {args.checkpoint} on {settings.device} ({settings.threads} threads) for up to {limit} "
              f"players ...", flush=True)

        def build():
            return Sessions.from_checkpoint(world, args.ckpt, settings=settings, capacity=limit, weights=args.weights,
                                            pp=ctx)

        def ready(scheduler):
            if ctx is None:  # two stages: rank 1 compiles, rank 0 never calls the model
                compile_in_background(scheduler.sessions.runner, settings, budget, serve_rows(limit, options.batched))

        running = []  # the web server, once it runs

        def failed(error):  # two stages broke: the other rank is told (unless it broke first), this server stops
            if not is_collective_error(error):
                ctx.fail(error)
            for web in running:
                web.should_exit = True

        scheduler = Scheduler(build, options, on_ready=ready, on_fail=failed, budget=budget)
        scheduler.start()
        scheduler.ready.wait()
        if scheduler.error is not None:
            raise scheduler.error
        end_startup()  # from here a stop signal stops the server gracefully
        # uvicorn stops gracefully on SIGTERM, then raises it again: exit through the finally
        # blocks below (the temporary recordings go) instead of the default handler's abrupt end
        for stop in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(stop) is not signal.SIG_IGN:
                signal.signal(stop, lambda signum, frame: sys.exit(128 + signum))
        if args.record_dir is None:  # made once start-up is over: an interrupted start leaves nothing
            temporary = tempfile.mkdtemp(prefix="owl-recordings-")
            options.record_dir = Path(temporary)
        limits = Limits(idle_timeout=args.idle_timeout, allow_origins=tuple(args.allow_origin),
                        loopback_only=is_loopback(sock))
        code = serve(scheduler, sock, limits, running)
        if isinstance(scheduler.error, TPError) or is_collective_error(scheduler.error):
            raise scheduler.error
        return code
    except USER_ERRORS as exc:
        if ctx is not None:
            ctx.fail(exc, flag_message(exc))
        prefix = f"rank {ctx.rank}: " if ctx is not None and not isinstance(exc, TPError) else ""
        print(f"error: {prefix}{flag_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        if ctx is not None and is_collective_error(exc):  # the other rank failed first: its reason
            print(f"error: rank {ctx.rank}: {flag_message(ctx.explain(exc))}", file=sys.stderr)
            return 2
        if ctx is not None:
            ctx.fail(exc, flag_message(exc))
        raise
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        if ctx is not None:
            ctx.shutdown()


def serve_rows(limit: int, batched: bool = True) -> list[int]:
    """The padded batch sizes the steps of up to ``limit`` players run at (a compiled graph each)."""
    return sorted({batch_rows(n) for n in range(1, limit + 1)}) if batched else [1]


def generate(args, world, settings, ctx: ParallelContext, mesh: ParallelContext | None) -> int:
    """A generating rank of ``--pp 2`` (``mesh``: its place among them, with ``--tp``): every
    session's cache (its heads) and every step's frames, until rank 0 stops."""
    limit = args.max_sessions or args.session_limit
    sessions = Sessions.from_checkpoint(world, args.ckpt, settings=settings, capacity=limit, weights=args.weights,
                                        pp=ctx, tp=mesh, verbose=False)
    compile_in_background(sessions.runner, settings, None, serve_rows(limit))
    end_startup()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's: it stops the server, then this rank
    sessions.follow()
    return 0


def one_line_client_faults(record: logging.LogRecord) -> bool:
    """A page's malformed websocket frame (a text message that is not UTF-8) is the page's fault,
    already answered by a close (1007): one log line, not the web server's traceback."""
    if record.exc_info and isinstance(record.exc_info[1], UnicodeDecodeError) and "UTF-8" in str(record.msg):
        record.msg, record.args, record.exc_info, record.exc_text = ("a page sent a text message that is not UTF-8 "
                                                                     "(closed with 1007)"), (), None, None
    return True


def serve(scheduler: Scheduler, sock: socket.socket, limits: Limits, running: list | None = None) -> int:
    """Serve the pages until stopped (``running`` gets the web server: a failure elsewhere stops it)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host  # (IPv6 in brackets)
    print(f"[owl] serving at http://{shown}:{port}/ : open it in a browser to play (Ctrl-C stops)", flush=True)
    config = uvicorn.Config(create_app(scheduler, limits), ws=page_socket_protocol(), ws_max_size=MAX_MESSAGE_BYTES,
                            log_level="warning", lifespan="off", timeout_graceful_shutdown=3)
    logging.getLogger("uvicorn.error").addFilter(one_line_client_faults)  # (after Config: it sets up logging)
    web = uvicorn.Server(config)
    if running is not None:
        running.append(web)
    try:
        web.run(sockets=[sock])
    finally:
        scheduler.stop()
        scheduler.join(timeout=10)
    return 0


if __name__ == "__main__":
    from .game_cv import exit_now

    exit_now(main())
