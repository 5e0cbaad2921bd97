"""Every command the README shows runs and exits 0. The app's commands, the A/B runs and the
tensor-parallel run go in the README's order in one folder (a later command reads what an
earlier one wrote: run.jsonl), made short by ``short``: a few frames, a window that closes
itself. The rest are run elsewhere, at their smallest sizes, by the tests ``ELSEWHERE`` names."""
import os
import shlex
import shutil
import subprocess
import sys

from .conftest import REPO, run_main, time_limit
from .test_readme import fenced_blocks, fenced_commands

FRAMES = "3"  # frames of every shortened rollout
# Commands of minutes or hours, by their first words: the tests that run them at tiny sizes.
ELSEWHERE = {
    "pip install": "the CI script (.ci/run), which test_readme checks",
    "python -m pytest": "the CI script (.ci/run), which test_readme checks",
    "python -m scripts.bench_pipeline": "tests/test_headless.py::test_bench_pipeline_measures_each_checkpoint_in_one_run",
    "python -m scripts.bench_kv": "tests/test_kv_quant.py (bench_kv's cache modes)",
    "python -m scripts.bench_play": "tests/test_benchmarks.py::test_bench_play_measures_the_window_with_and_without_overlay",
    "python -m scripts.bench_compile": "tests/test_benchmarks.py::test_bench_compile_measures_eager_and_compiled_modes",
    "python -m scripts.bench_tp": "tests/test_benchmarks.py::test_bench_tp_times_tp1_and_tp2_and_compares_their_frames",
    "python -m scripts.bench_pp": "tests/test_benchmarks.py::test_bench_pp_times_decoding_in_line_on_a_thread_and_in_two_stages",
    "python -m scripts.bench_frame": "tests/test_benchmarks.py::test_bench_frame_times_every_path_against_the_default_and_the_floor",
    "python -m scripts.bench_shared_cores": "tests/test_benchmarks.py::test_bench_shared_cores_runs_the_command_alone_and_beside_a_busy_process",
    "python -m scripts.bench_serve": "tests/test_benchmarks.py::test_bench_serve_drives_players_against_the_batched_and_the_one_by_one_server",
    "python -m inference.serve": "tests/test_serve_browser.py::test_two_browsers_play_their_own_sessions_and_a_third_hears_the_server_is_full",
    "torchrun --nproc-per-node 2 -m inference.serve": "tests/test_serve.py::test_two_stages_serve_each_player_the_frames_of_its_run_alone",
    "python -m scripts.bench_train": "tests/test_benchmarks.py::test_bench_train_times_eager_compiled_and_dense_steps",
    "python -m scripts.generate_data": "tests/test_training.py (every stage of the chain) and test_readme",
    "python -m scripts.train_vae": "tests/test_training.py (every stage of the chain) and test_readme",
    "python -m scripts.encode_latents": "tests/test_training.py (every stage of the chain) and test_readme",
    "python -m scripts.train_world": "tests/test_training.py (every stage of the chain) and test_readme",
    "python -m scripts.export_checkpoint": "tests/test_training.py (every stage of the chain) and test_readme",
    "python -m scripts.eval_world": "tests/test_eval.py::test_eval_command_on_two_short_episodes",
}
RUN_HERE = ("python -m inference.game_cv", "python -m scripts.ab_kv", "torchrun")


def shell_commands() -> list[str]:
    """The README's shell commands: its fenced blocks but the Python example (test_readme runs it)."""
    return fenced_commands([block for block in fenced_blocks() if "import " not in block])


def parse(command: str) -> tuple[dict, list[str]]:
    """(leading NAME=VALUE environment, argv) of a command, its trailing comment dropped."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and "=" in words[0] and words[0].split("=")[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def replace(argv: list[str], flag: str, value: str, add: bool = True) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value] if add else argv


def short(argv: list[str]) -> list[str]:
    """The command made short: rollouts and A/B runs of a few frames, windows that close
    themselves after a few frames, rollouts driven by an action file at its own length."""
    if "inference.game_cv" in argv:
        if "--headless" not in argv:
            return argv + ["--max-frames", FRAMES]
        actions_file = "--actions" in argv and argv[argv.index("--actions") + 1].endswith(".jsonl")
        return replace(argv, "--frames", FRAMES, add=not actions_file)
    if "scripts.ab_kv" in argv:
        return replace(argv, "--frames", "2", add="--actions" not in argv)
    return argv


def test_every_readme_command_is_run_here_or_by_a_named_test():
    commands = shell_commands()
    assert len(commands) >= 20
    unmatched = [c for c in commands
                 if not parse(c)[1] or not (" ".join(parse(c)[1]).startswith(RUN_HERE)
                                            or any(" ".join(parse(c)[1]).startswith(k) for k in ELSEWHERE))]
    assert not unmatched, "README commands no test runs:\n" + "\n".join(unmatched)
    for place in ELSEWHERE.values():
        path = REPO / place.split("::")[0].split(" ")[0]
        assert path.exists() or place.startswith("the CI script"), place
        if "::" in place:
            assert f"def {place.split('::')[1]}(" in path.read_text(), place


def test_the_readme_commands_run_in_order(tmp_path):
    """The README's app, A/B and TP commands, shortened, from one folder, each exit status 0."""
    base_env = {"SDL_VIDEODRIVER": "dummy", "SDL_AUDIODRIVER": "dummy",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    ran = []
    for command in shell_commands():
        env, argv = parse(command)
        if not " ".join(argv).startswith(RUN_HERE) or " ".join(argv).startswith(tuple(ELSEWHERE)):
            continue  # a server runs until stopped: its test plays it
        argv = short(argv)
        if "my_actions.jsonl" in argv:  # "your own" action file: the one the window recorded
            shutil.copy(tmp_path / "run.jsonl", tmp_path / "my_actions.jsonl")
        if argv[0] == "torchrun":
            child_env = {k: v for k, v in os.environ.items() if not k.startswith("OWL_") or k == "OWL_THREADS"}
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]], cwd=tmp_path,
                               env={**child_env, **base_env, **env}, capture_output=True, text=True,
                               timeout=time_limit(240))
            rc, out, err = p.returncode, p.stdout, p.stderr
        else:
            r = run_main(argv[2], argv[3:], {**base_env, **env}, cwd=tmp_path)
            rc, out, err = r.returncode, r.stdout, r.stderr
        assert rc == 0, f"{command}\n(run as {shlex.join(argv)})\n{out[-2000:]}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{command}\n{err[-3000:]}"
        ran.append(command)
    made = {p.name for p in tmp_path.iterdir()}
    assert {"rollout.mp4", "run.mp4", "run.jsonl", "walk.mp4", "replay.mp4", "gt.mp4", "beside.mp4", "beside.png",
            "int4.mp4", "p.mp4", "tp2.mp4", "pp2.mp4", "eval"} <= made, made
    assert (tmp_path / "eval" / "ab" / "report.md").exists()
    assert len(ran) >= 14
