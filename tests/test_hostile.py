"""Hostile and careless input to the app: every case ends with a one-line error that names the
thing, the value and the fix; no traceback, a non-zero exit status and no file left behind."""
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.game_cv import main

from .conftest import REPO, run_main

TINY = REPO / "checkpoints" / "untrained-tiny"


def tiny_copy(tmp_path, config_edit=None, weights_edit=None):
    """A copy of the tiny checkpoint with its config text or weights changed."""
    folder = tmp_path / "ckpt"
    shutil.copytree(TINY, folder)
    if config_edit is not None:
        (folder / "config.yaml").write_text(config_edit((folder / "config.yaml").read_text()))
    if weights_edit is not None:
        state = load_file(str(folder / "model.safetensors"))
        weights_edit(state)
        save_file(state, str(folder / "model.safetensors"))
    return folder


def sub(pattern, repl):
    return lambda text: re.sub(pattern, repl, text, flags=re.M)


def vae_edit(edit):
    """A copy of the tiny checkpoint whose VAE folder ``edit(folder)`` changed."""
    def make(tmp):
        folder = tiny_copy(tmp)
        edit(folder / "vae")
        return ["--checkpoint", str(folder)]
    return make


def truncate_half(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


class Payload:
    """A pickle whose loading would create a file beside it (the test checks it never appears)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled_only(vae):
    import pickle

    (vae / "diffusion_pytorch_model.safetensors").unlink()
    (vae / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(Payload(vae / "PAYLOAD_RAN")))


def nan_first(state):
    key = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[key] = torch.full_like(state[key], float("nan"))


def action_file(*lines):
    def make(tmp):
        (tmp / "a.jsonl").write_text("".join(x + "\n" for x in lines))
        return ["--actions", str(tmp / "a.jsonl")]
    return make


FRAME = json.dumps({"mouse": [0, 0], "buttons": [0] * 11})

# id -> (extra argv or a function of tmp_path giving it, OWL_* flags, expected message regex)
CASES = {
    # command-line values
    "frames-zero": (["--frames", "0"], {}, r"--frames 0: must be a whole number in \[1, 100000\]"),
    "frames-negative": (["--frames", "-5"], {}, r"--frames -5: must be"),
    "frames-billion": (["--frames", "1000000000"], {}, r"--frames 1000000000: must be a whole number in \[1, 100000\]"),
    "frames-text": (["--frames", "abc"], {}, r"--frames 'abc': must be a whole number"),
    "scale-zero": (["--scale", "0"], {}, r"--scale 0: must be"),
    "scale-huge": (["--scale", "400"], {}, r"--scale 400: must be a whole number in \[1, 16\]"),
    "tp-zero": (["--tp", "0"], {}, r"--tp 0: must be"),
    "fps-zero": (["--fps", "0"], {}, r"--fps 0.0: must be a number in \[0.1, 1000\]"),
    "fps-tiny": (["--fps", "1e-9"], {}, r"--fps 1e-09: must be a number in \[0.1, 1000\]"),
    "fps-negative": (["--fps", "-5"], {}, r"--fps -5.0: must be"),
    "fps-nan": (["--fps", "nan"], {}, r"--fps nan: must be"),
    "fps-inf": (["--fps", "inf"], {}, r"--fps inf: must be"),
    "target-fps-zero": (["--target-fps", "0"], {}, r"--target-fps 0.0: must be"),
    "sensitivity-negative": (["--sensitivity", "-1"], {}, r"--sensitivity -1.0: must be"),
    "world-seed-negative": (["--world-seed", "-1"], {}, r"--world-seed -1: must be a whole number in \[0, 2147483647\]"),
    "world-seed-huge": (["--world-seed", str(2**40)], {}, r"--world-seed 1099511627776: must be"),
    "seed-negative": (["--seed", "-1"], {}, r"--seed -1: must be"),
    "seed-huge": (["--seed", str(2**70)], {}, r"--seed \d+: must be a whole number in \[0, 9223372036854775807\]"),
    "sheet-every-zero": (["--sheet-every", "0"], {}, r"--sheet-every 0: must be"),
    "max-frames-zero": (["--max-frames", "0"], {}, r"--max-frames 0: must be a whole number >= 1"),
    "weights-unknown": (["--weights", "bogus"], {}, r"--weights: invalid choice: 'bogus'"),
    "ground-truth-too-long": (["--ground-truth", "--frames", "100000"], {},
                              r"--ground-truth: the clip records \d+ future actions; ask for at most --frames \d+"),
    # window options with --headless
    "replay-headless": (["--replay", "a.jsonl"], {}, r"--replay is a window option, not used with --headless: give "
                                                     r"the action file as --actions FILE"),
    "record-headless": (["--record", "r.mp4"], {}, r"--record is a window option, not used with --headless"),
    "save-actions-headless": (["--save-actions", "s.jsonl"], {}, r"--save-actions is a window option"),
    # output paths, refused before any work
    "out-suffix": (lambda t: ["--out", str(t / "x.avi")], {}, r"--out '.*x\.avi' must end in \.mp4"),
    "out-empty": (["--out", ""], {}, r"--out is empty; give a file name ending in \.mp4"),
    "save-frames-empty": (["--save-frames", ""], {}, r"--save-frames is empty; give a file name ending in \.npy"),
    "sheet-empty-batched": (["--sheet", "", "--sessions", "2"], {}, r"--sheet is empty; give a file name ending in \.png"),
    "out-missing-folder": (lambda t: ["--out", str(t / "no" / "x.mp4")], {}, r"output folder '.*no' does not exist"),
    "out-is-folder": (lambda t: (t / "d.mp4").mkdir() or ["--out", str(t / "d.mp4")], {}, r"--out '.*d\.mp4' is a folder"),
    "out-is-folder-without-suffix": (lambda t: ["--out", str(t)], {}, r"--out '.*in' is a folder; give a file name"),
    "save-frames-suffix": (lambda t: ["--save-frames", str(t / "f.txt")], {}, r"--save-frames '.*f\.txt' must end in \.npy"),
    "save-frames-is-folder": (lambda t: (t / "f.npy").mkdir() or ["--save-frames", str(t / "f.npy")], {},
                              r"--save-frames '.*f\.npy' is a folder"),
    "sheet-suffix": (lambda t: ["--sheet", str(t / "s.jpg")], {}, r"--sheet '.*s\.jpg' must end in \.png"),
    "sheet-is-folder": (lambda t: (t / "s.png").mkdir() or ["--sheet", str(t / "s.png")], {}, r"--sheet '.*s\.png' is a folder"),
    "tp-without-torchrun": (["--tp", "2"], {}, r"--tp 2 needs 2 processes started by torchrun"),
    "pp-without-torchrun": (["--pp", "2"], {}, r"--pp 2 needs 2 processes started by torchrun"),
    "pp-with-tp": (["--pp", "2", "--tp", "2"], {}, r"--pp 2 --tp 2 needs 3 processes started by torchrun"),
    "pp-three": (["--pp", "3"], {}, r"argument --pp: invalid choice: 3"),
    # action scripts and files
    "actions-missing": (["--actions", "nowhere.jsonl"], {},
                        r"--actions 'nowhere\.jsonl' is neither a built-in script .* \(no such file\)"),
    "actions-misspelled": (["--actions", "walk_trun"], {}, r"--actions 'walk_trun' .* \(did you mean 'walk_turn'\?\)"),
    "actions-builtin-arg": (["--actions", "forward:3"], {}, r"action script 'forward:3': only 'random' takes a seed"),
    "actions-random-seed-text": (["--actions", "random:abc"], {},
                                 r"action script 'random:abc': the seed after 'random:' is a whole number"),
    "actions-bad-json": (action_file("{mouse: 1}"), {}, r"a\.jsonl:1: not valid JSON"),
    "actions-empty": (action_file(""), {}, r"action file '.*a\.jsonl' holds no frames"),
    "actions-only-events": (action_file('{"event": "restart"}'), {}, r"holds no frames"),
    "actions-binary": (lambda t: [(t / "a.jsonl").write_bytes(b"\xff\xfe\x00garbage"), "--actions", str(t / "a.jsonl")][1:],
                       {}, r"action file '.*a\.jsonl' is not a text file of JSON lines"),
    "actions-unknown-event": (action_file(FRAME, '{"event": "explode"}'), {}, r"a\.jsonl:2: unknown or malformed event"),
    "actions-clip-null": (action_file(FRAME, '{"event": "clip", "clip": null}'), {},
                          r"a\.jsonl:2: event 'clip' has clip=None; it must be a clip index"),
    "actions-clip-negative": (action_file(FRAME, '{"event": "clip", "clip": -2}'), {}, r"clip=-2; it must be"),
    "actions-on-string": (action_file(FRAME, '{"event": "ground_truth", "on": "false"}'), {},
                          r"event 'ground_truth' has on='false'; it must be true or false"),
    "actions-seed-fraction": (action_file(FRAME, '{"event": "world_seed", "seed": 3.7}'), {},
                              r"event 'world_seed' has seed=3\.7; it must be a simulator level"),
    "actions-bias-null": (action_file(FRAME, '{"event": "bias", "value": null}'), {}, r"event 'bias' has value=None"),
    "actions-bias-huge": (action_file(FRAME, '{"event": "bias", "value": 1e9}'), {}, r"value=1000000000\.0; it must be a number in \[-100, 100\]"),
    "actions-mouse-nan": (action_file('{"mouse": [NaN, 0], "buttons": [0,0,0,0,0,0,0,0,0,0,0]}'), {},
                          r"a\.jsonl:1: mouse must be 2 finite numbers"),
    "actions-mouse-huge": (action_file('{"mouse": [1e308, 0], "buttons": [0,0,0,0,0,0,0,0,0,0,0]}'), {},
                           r"a\.jsonl:1: mouse must be 2 finite numbers of at most 1e\+06 in size, got \[1e\+308, 0\]"),
    "actions-mouse-short": (action_file('{"mouse": [1], "buttons": [0,0,0,0,0,0,0,0,0,0,0]}'), {}, r"mouse must be 2"),
    "actions-buttons-short": (action_file('{"mouse": [0, 0], "buttons": [1, 0]}'), {}, r"buttons must be 11 values of 0/1"),
    "actions-buttons-bool": (action_file('{"mouse": [0, 0], "buttons": [true,0,0,0,0,0,0,0,0,0,0]}'), {},
                             r"buttons must be 11 values of 0/1"),
    "actions-long-line": (action_file(json.dumps({"mouse": [0, 0], "buttons": list(range(5000))})), {},
                          r"buttons must be 11 values of 0/1 \(W A S D.*\.\.\. \(\d+ chars\)"),
    "actions-more-frames-asked": (lambda t: action_file(FRAME)(t) + ["--frames", "5"], {},
                                  r"has 1 frames of actions but 5 frames were asked; pass --frames 1 or fewer"),
    # OWL_* flags
    "env-device": ([], {"OWL_DEVICE": "tpu"}, r"OWL_DEVICE='tpu' is malformed; accepted values: cpu\|cuda"),
    "env-dtype": ([], {"OWL_DTYPE": "fp64"}, r"OWL_DTYPE='fp64' is malformed"),
    "env-seed": ([], {"OWL_SEED": "-1"}, r"OWL_SEED='-1' is malformed; accepted values: an integer in \[0, 9223372036854775807\]"),
    "env-threads": ([], {"OWL_THREADS": "many"}, r"OWL_THREADS='many' is malformed"),
    "env-storage": ([], {"OWL_KV_STORAGE": "int3"}, r"OWL_KV_STORAGE='int3' is malformed"),
    "env-bits": ([], {"OWL_KV_BITS": "5"}, r"OWL_KV_BITS='5' is malformed"),
    "env-fp8-bf16-clash": ([], {"OWL_KV_STORAGE": "bf16", "OWL_FP8_KV": "1"},
                           r"OWL_FP8_KV='1' and OWL_KV_STORAGE='bf16' contradict: the first asks for a quantized cache"),
    "env-storage-bits-clash": ([], {"OWL_KV_STORAGE": "fp8_e4m3", "OWL_KV_BITS": "8"},
                               r"OWL_KV_STORAGE='fp8_e4m3' and OWL_KV_BITS='8' contradict"),
    "env-ring": ([], {"OWL_RING_MODE": "spiral"}, r"OWL_RING_MODE='spiral' is malformed; accepted values: roll\|pointer\|inplace"),
    "env-bias": ([], {"OWL_KV_CACHE_ATTENTION_BIAS": "1000"}, r"OWL_KV_CACHE_ATTENTION_BIAS='1000' is malformed"),
    "env-timeout": ([], {"OWL_TP_TIMEOUT": "0"}, r"OWL_TP_TIMEOUT='0' is malformed"),
    "env-recompute-nocache": ([], {"OWL_KV_RECOMPUTE_EVERY": "4", "OWL_KV_CACHE": "none"},
                              r"OWL_KV_RECOMPUTE_EVERY='4' rebuilds the KV cache, but OWL_KV_CACHE='none'"),
    "env-late-layers-too-many": ([], {"OWL_KV_STORAGE": "int8", "OWL_KV_LATE_LAYERS": "99"},
                                 r"OWL_KV_LATE_LAYERS=99 exceeds the model's \d+ layers"),
    "env-share-too-many": ([], {"OWL_KV_SHARE": "99"}, r"OWL_KV_SHARE=99 exceeds the model's \d+ layers"),
    # checkpoints, configs and clips
    "checkpoint-weights-file": (lambda t: [(t / "model.safetensors").write_bytes(b"\xbe\x00"), "--checkpoint",
                                           str(t / "model.safetensors")][1:], {},
                                r"'.*model\.safetensors' is a file of a checkpoint, not its config: pass the "
                                r"checkpoint's folder"),
    "checkpoint-missing": (lambda t: ["--checkpoint", str(t / "nowhere")], {},
                           r"checkpoint '.*nowhere' does not exist; pass a checkpoint folder"),
    "checkpoint-misspelled": (["--checkpoint", str(REPO / "checkpoints" / "maze-wrold")], {},
                              r"checkpoint '.*maze-wrold' does not exist \(did you mean '.*checkpoints/maze-world'\?\)"),
    "checkpoint-folder-without-config": (["--checkpoint", str(REPO / "configs")], {},
                                         r"folder '.*configs' is not a checkpoint: it holds no config\.yaml"),
    "ckpt-missing": (["--ckpt", "nowhere.safetensors"], {}, r"nowhere\.safetensors"),
    "config-without-weights": (lambda t: ["--checkpoint", str(REPO / "configs" / "untrained_tiny.yaml")], {},
                               r"config '.*untrained_tiny\.yaml' has no weights beside it .*; the checkpoint folder "
                               r"'.*untrained-tiny' holds this world with its weights: pass that folder as the "
                               r"checkpoint \(--checkpoint\), or pass the weights file with --ckpt"),
    "config-of-another-model-without-weights": (lambda t: ["--checkpoint", str(REPO / "configs" / "maze_world.yaml")], {},
                                                r"config '.*maze_world\.yaml' has no weights beside it \([^)]*\); "
                                                r"pass the weights file with --ckpt"),
    "ckpt-garbage": (lambda t: [(t / "w.safetensors").write_bytes(b"not a tensor file"), "--ckpt", str(t / "w.safetensors")][1:],
                     {}, r"w\.safetensors"),
    "weights-nan": (lambda t: ["--checkpoint", str(tiny_copy(t, weights_edit=nan_first))], {},
                    r"holds non-finite weights \(NaN or inf\) in 1 tensors"),
    "config-vae-scale-zero": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"vae_scale: .*", "vae_scale: 0")))], {},
                              r"train\.vae_scale=0 must be a positive number"),
    "config-vae-scale-text": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"vae_scale: .*", "vae_scale: abc")))], {},
                              r"train\.vae_scale='abc' must be a positive number"),
    "config-window-text": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"window_frames: .*", "window_frames: abc")))],
                           {}, r"pipeline\.window_frames='abc' must be a whole number"),
    "config-alpha": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"history_alpha: .*", "history_alpha: 2")))], {},
                     r"pipeline\.history_alpha=2 must be a number in \[0, 1\)"),
    "config-heads-zero": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"n_heads: .*", "n_heads: 0")))], {},
                          r"model\.n_heads=0 is not supported: must be a positive integer"),
    "config-size-text": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"sample_size: .*", 'sample_size: "8"')))], {},
                         r"model\.sample_size='8' is not supported"),
    "config-not-yaml": (lambda t: ["--checkpoint", str(tiny_copy(t, lambda s: s + "\n  : : [\n"))], {}, r"is not valid YAML"),
    "config-simulator-typo": (lambda t: ["--checkpoint", str(tiny_copy(t, lambda s: s + "simulator:\n  corrdor: 2\n"))], {},
                              r"unknown simulator keys \['corrdor'\]"),
    "clip-out-of-range": (["--clip", "99"], {}, r"clip 99 does not exist: world '.*' has \d+ clips"),
    "clip-folder": (lambda t: ["--clip", str(t)], {}, r"clip '.*in' is a folder; give a clip \.safetensors file"),
    "clip-garbage": (lambda t: [(t / "c.safetensors").write_bytes(b"\x00" * 64), "--clip", str(t / "c.safetensors")][1:], {},
                     r"clip '.*c\.safetensors' is not a readable safetensors file"),
    "ckpt-folder": (lambda t: ["--ckpt", str(t)], {}, r"checkpoint file '.*in' is a folder; pass the weights file in it"),
    "config-section-not-mapping": (lambda t: ["--checkpoint", str(tiny_copy(t, lambda s: s + "controls: 5\n"))], {},
                                   r"the controls: section must be a mapping"),
    "config-interpolation": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"vae_scale: .*", "vae_scale: ${nope}")))], {},
                             r"config file '.*config\.yaml': Interpolation key 'nope' not found"),
    "config-flag-text": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"^  trained: false$", "  trained: 'no'")))],
                         {}, r"decoder\.trained='no' must be true or false"),
    "actions-event-list": (action_file(FRAME, '{"event": [1]}'), {}, r"a\.jsonl:2: unknown or malformed event"),
    "actions-deep-json": (action_file("[" * 100000 + "]" * 100000), {}, r"a\.jsonl:1: JSON nested too deeply"),
    "actions-folder": (lambda t: ["--actions", str(t)], {}, r"is neither a built-in script"),
    "env-threads-huge": ([], {"OWL_THREADS": "100000000"}, r"OWL_THREADS='100000000' is malformed; accepted values: an integer in \[0, 1024\]"),
    "clip-missing-file": (["--clip", "nowhere.safetensors"], {}, r"nowhere\.safetensors"),
    "clip-with-world-seed": (["--clip", "1", "--world-seed", "3"], {},
                             r"--clip 1 and --world-seed 3 both choose where play starts; give one"),
    "clip-superscript-digit": (["--clip", "\u00b2"], {}, r"clip file '\u00b2' does not exist"),
    "actions-restore-first": (action_file(FRAME, '{"event": "restore"}'), {},
                              r"a\.jsonl:2: a restore event before any snapshot event; add \{\"event\": \"snapshot\"\}"),
    "actions-clip-missing": (action_file(FRAME, '{"event": "clip", "clip": 99}'), {},
                             r"a\.jsonl:2: clip 99 does not exist: this world has \d+ clips"),
    "sheet-every-without-sheet": (["--sheet-every", "3"], {}, r"--sheet-every sets the frame step of --sheet; add --sheet"),
    "target-fps-headless": (["--target-fps", "30"], {}, r"--target-fps is a window option, not used with --headless"),
    "sheet-name-too-long": (lambda t: ["--sheet", str(t / ("a" * 250 + ".png"))], {},
                            r"--sheet '.*': cannot create .*File name too long.*choose another --sheet"),
    "ground-truth-sessions-too-long": (["--ground-truth", "--frames", "100000", "--sessions", "2"], {"OWL_RING_MODE": "inplace"},
                                       r"--ground-truth: the clip records \d+ future actions; ask for at most"),
    "ckpt-pickled-payload": (lambda t: [(t / "payload.pt").write_bytes(__import__("pickle").dumps(Payload(t / "RAN"))),
                                         "--ckpt", str(t / "payload.pt")][1:], {},
                             r"checkpoint file '.*payload\.pt' holds pickled objects other than tensors, which are "
                             r"never loaded \(they could run code\)"),
    # the autoencoder folder beside the checkpoint
    "vae-config-not-json": (vae_edit(lambda v: (v / "config.json").write_text("{not json")), {},
                            r"decoder\.path: '.*vae/config\.json' is not valid JSON .*; restore the file"),
    "vae-config-not-object": (vae_edit(lambda v: (v / "config.json").write_text("[1, 2]")), {},
                              r"config\.json' holds a JSON list, not an object"),
    "vae-weights-truncated": (vae_edit(lambda v: truncate_half(v / "diffusion_pytorch_model.safetensors")), {},
                              r"diffusion_pytorch_model\.safetensors' is truncated: its header describes \d+ bytes"),
    "vae-weights-garbage": (vae_edit(lambda v: (v / "diffusion_pytorch_model.safetensors").write_bytes(b"\xff" * 64)),
                            {}, r"diffusion_pytorch_model\.safetensors' is not a readable safetensors file"),
    "vae-weights-pickled-only": (vae_edit(pickled_only), {},
                                 r"'.*vae' holds only pickled weights \(diffusion_pytorch_model\.bin\), which are "
                                 r"never loaded .*safe_serialization=True"),
    "vae-class-not-autoencoder": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"class: AutoencoderTiny",
                                                                                  "class: UNet2DModel")))], {},
                                  r"config\.yaml: decoder\.class='UNet2DModel' is not a diffusers autoencoder"),
    "vae-class-not-a-class": (lambda t: ["--checkpoint", str(tiny_copy(t, sub(r"class: AutoencoderTiny",
                                                                              "class: logging")))], {},
                              r"decoder\.class='logging' is not a diffusers autoencoder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_refused_with_a_clear_message_and_no_file(case, tmp_path):
    argv, env, expected = CASES[case]
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv = argv(inputs) if callable(argv) else argv
    work = tmp_path / "out"
    work.mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    # the case's own options come last and win
    r = run_main("inference.game_cv", ["--headless", "--checkpoint", TINY, "--frames", "2", "--out", work / "x.mp4", *argv],
                 {"OWL_DEVICE": "cpu", **env}, cwd=work)
    rc, text = r.returncode, r.stdout + r.stderr
    assert rc != 0, f"exit status {rc}: {text[-2000:]}"
    assert "Traceback" not in text, text[-3000:]
    assert re.search(expected, text), text[-2000:]
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before, f"left behind: {sorted(set(after) - set(before))}"


@pytest.mark.parametrize("argv,flag", [(["--out", "x.mp4"], "--out"), (["--frames", "5"], "--frames"),
                                       (["--actions", "turn"], "--actions"), (["--sheet", "s.png"], "--sheet")])
def test_a_headless_option_without_headless_is_refused(argv, flag, tmp_path):
    """A window run given a rollout's options (--headless forgotten) says so instead of ignoring them."""
    r = run_main("inference.game_cv", ["--checkpoint", TINY, *argv], {"OWL_DEVICE": "cpu"}, cwd=tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in text
    assert f"{flag} is a --headless option" in text and "add --headless" in text, text[-1500:]
    assert list(tmp_path.iterdir()) == []


def test_the_hostile_suite_covers_every_input_class():
    assert len(CASES) >= 60


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs."""
    import subprocess

    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_rollout_larger_than_the_free_space_is_refused_before_any_frame(tiny_disk, capsys):
    """On a 64 KiB tmpfs a 64-frame rollout is refused once the frame size is known, before any
    frame, with the estimate and the free space; a 2-frame video at --scale 1 fits and is written."""
    from inference.video import count_frames

    rc = main(["--headless", "--checkpoint", str(TINY), "--frames", "64", "--out", str(tiny_disk / "x.mp4")])
    text = "".join(capsys.readouterr())
    assert rc == 2 and "Traceback" not in text
    assert re.search(r"--out '.*x\.mp4' needs about \d+ KiB but only \d+ KiB is free in .*; free some space", text)
    assert list(tiny_disk.iterdir()) == []
    rc = main(["--headless", "--checkpoint", str(TINY), "--frames", "2", "--scale", "1", "--out", str(tiny_disk / "y.mp4")])
    assert rc == 0 and [p.name for p in tiny_disk.iterdir()] == ["y.mp4"] and count_frames(tiny_disk / "y.mp4") == 2


def test_a_disk_that_fills_during_the_video_keeps_nothing(tiny_disk):
    """The disk fills after the start-up check: ffmpeg fails on a real ENOSPC and no file is left."""
    from inference import video

    writer = video.Mp4Writer(tiny_disk / "x.mp4", fps=15)
    (tiny_disk / "ballast").write_bytes(b"\0" * (56 << 10))
    noise = np.random.default_rng(0).integers(0, 256, (40, 128, 128, 3), dtype=np.uint8)
    with pytest.raises(video.OutputWriteError, match=r"nothing was kept"):
        for frame in noise:
            writer.write(frame)
        writer.close()
    writer.close()
    assert [p.name for p in tiny_disk.iterdir()] == ["ballast"]


def test_a_writer_that_fails_midway_keeps_nothing(tmp_path, monkeypatch):
    """ffmpeg stopping mid-video (a disk filling up after start-up) leaves no file and says so."""
    from inference import video

    writer = video.Mp4Writer(tmp_path / "x.mp4", fps=15)
    writer.write(np.zeros((16, 16, 3), np.uint8))

    class Broken:
        def send(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    writer._gen = Broken()
    with pytest.raises(video.OutputWriteError, match=r"writing '.*x\.mp4' failed after 1 frames .*nothing was kept"):
        writer.write(np.zeros((16, 16, 3), np.uint8))
    assert writer.close() is None and list(tmp_path.iterdir()) == []


def test_an_unfinished_mp4_is_not_moved_into_place(tmp_path):
    from inference import video

    writer = video.Mp4Writer(tmp_path / "x.mp4", fps=15)
    writer.write(np.zeros((16, 16, 3), np.uint8))
    writer._gen.close()
    writer._gen = None
    writer.partial.write_bytes(b"\x00" * 64)  # truncated: no index
    with pytest.raises(video.OutputWriteError, match="could not finish"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_second_writer_of_the_same_output_leaves_the_first_ones_video_alone(tmp_path):
    """Two runs with the same --out each write their own hidden file; a run started (or refused)
    meanwhile never removes the other's, and the last to finish is the file left."""
    import os

    from inference import video

    other = tmp_path / f".x.{os.getpid() + 1}-0.partial.mp4"  # another process's video in progress
    other.write_bytes(b"frames")
    first = video.Mp4Writer(tmp_path / "x.mp4", fps=15)
    second = video.Mp4Writer(tmp_path / "x.mp4", fps=15)
    assert other.read_bytes() == b"frames"
    for _ in range(3):  # both at once
        first.write(np.zeros((16, 16, 3), np.uint8))
        second.write(np.zeros((16, 16, 3), np.uint8))
    second.write(np.zeros((16, 16, 3), np.uint8))
    second.close()
    assert video.count_frames(tmp_path / "x.mp4") == 4
    first.close()
    assert video.count_frames(tmp_path / "x.mp4") == 3 and other.exists()


@pytest.mark.parametrize("flag,suffix", [("--save-frames", ".npy"), ("--sheet", ".png"), ("--out", ".mp4")])
def test_an_output_name_the_folder_refuses_is_an_error_before_any_work(tmp_path, flag, suffix):
    from inference import video

    with pytest.raises(video.OutputPathError, match=f"{flag} .*cannot create .*File name too long.*choose another {flag}"):
        video.check_output_path(tmp_path / ("a" * 250 + suffix), suffix=suffix, flag=flag)
    assert list(tmp_path.iterdir()) == []


def test_ignored_signals_stay_ignored_and_the_others_finish_the_video():
    """nohup's ignored SIGHUP must not stop a run; SIGINT, SIGTERM and an unignored SIGHUP ask for a stop."""
    import signal

    from inference.signals import StopOnSigint

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopOnSigint() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)
            assert stop.requested
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with StopOnSigint() as stop:
            signal.raise_signal(signal.SIGHUP)
            assert stop.requested
        before_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell leaves a background job
        try:
            with StopOnSigint() as stop:
                signal.raise_signal(signal.SIGINT)  # a Ctrl-C sent to the process group still finishes the video
                assert stop.requested
        finally:
            signal.signal(signal.SIGINT, before_int)
    finally:
        signal.signal(signal.SIGHUP, before)


def test_what_the_app_writes_it_reads_back():
    """Recorded actions round-trip: fast mouse moves, every event kind, a level seed near the top."""
    from inference.actions import parse_action

    items = [([12000.0, -3.5], [1] + [0] * 10), {"event": "world_seed", "seed": 2**31 - 1},
             {"event": "bias", "value": -0.5}, {"event": "ground_truth", "on": True}, {"event": "clip", "clip": 2}]
    for item in items:
        obj = json.loads(json.dumps(item if isinstance(item, dict) else {"mouse": item[0], "buttons": item[1]}))
        assert parse_action(obj, "x") == (item if isinstance(item, dict) else (list(item[0]), list(item[1])))


def test_fp8_weights_load_and_thread_counts_stay_out_of_the_rank_agreement(tmp_path):
    from owl_wms.config import load_config
    from owl_wms.loading import build_model, load_weights
    from owl_wms.parallel import digest
    from owl_wms.settings import Settings

    world = load_config(TINY / "config.yaml")
    state = {k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v
             for k, v in load_file(str(TINY / "model.safetensors")).items()}
    load_weights(build_model(world.model), state, "fp8 copy")  # isfinite has no fp8 kernel: checked in fp32
    assert digest(Settings(threads=1), world, "w") == digest(Settings(threads=8), world, "w")
