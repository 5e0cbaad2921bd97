"""Control guidance (PipelineConfig.guidance): the first step's prediction is the prediction with
the mouse at rest moved ``guidance`` times as far towards the prediction with the player's mouse,
in one more model call; 1 makes no extra call. The config, the apps' --guidance and snapshots
carry it."""
import pytest
import torch

from inference.causvid_pipeline import CausvidPipeline
from owl_wms.config import ConfigError, load_config
from owl_wms.engine.build import startup_text

from .conftest import REPO, fp32_settings, random_model, tiny_config, tiny_world

WINDOW = 5


def guided_pipe(cfg, model, guidance: float, schedule=(1.0, 0.25, 0.0)) -> CausvidPipeline:
    world = tiny_world(cfg, WINDOW).with_guidance(guidance)
    pipe = CausvidPipeline(model, None, world, fp32_settings(), verbose=False)
    pipe.schedule = schedule
    g = torch.Generator().manual_seed(3)
    c, s = cfg.channels, cfg.sample_size
    pipe.prefill(torch.randn(WINDOW, c, s, s, generator=g), torch.randn(WINDOW, 2, generator=g),
                 (torch.rand(WINDOW, 11, generator=g) > 0.5).float())
    return pipe


def by_hand(pipe, noise, mouse, buttons, guidance: float, schedule) -> torch.Tensor:
    """The guided Euler sample from the model's own calls over the pipeline's cache, written nowhere."""
    runner = pipe.runner
    m, b = runner.inputs(mouse.view(1, 1, 2), buttons.view(1, 1, 11))
    x = noise.clone()
    for i, (t, nxt) in enumerate(zip(schedule, schedule[1:])):
        level = torch.full((1, 1), t)
        v = runner.call(x, level, m, b, pipe.cache, 0.0, False)
        if i == 0:
            rest = runner.call(x, level, torch.zeros_like(m), b, pipe.cache, 0.0, False)
            v = rest + guidance * (v - rest)
        x = x - (t - nxt) * v
    return x


@pytest.mark.parametrize("schedule", [(1.0, 0.25, 0.0), (1.0, 0.0)])
def test_a_guided_frame_moves_the_rest_prediction_guidance_times_as_far(schedule):
    """Two steps, and one step, whose call writes the cache: the rest call reads the cache as it
    was before the frame, and the frame is the guided Euler sample."""
    cfg = tiny_config()
    model = random_model(cfg)
    mouse, buttons = torch.tensor([4.0, -1.0]), (torch.arange(11) % 3 == 0).float()
    noise = torch.randn(1, 1, cfg.channels, cfg.sample_size, cfg.sample_size, generator=torch.Generator().manual_seed(7))
    pipe = guided_pipe(cfg, model, 1.5, schedule)
    expected = by_hand(pipe, noise, mouse, buttons, 1.5, schedule)
    calls = pipe.lifecycle.model_calls
    made = pipe.generate(mouse, buttons, noise=noise)
    assert torch.allclose(made, expected, atol=1e-5)
    assert pipe.lifecycle.model_calls - calls == len(schedule)  # a call a step and the rest call
    unguided = guided_pipe(cfg, model, 1.0, schedule)
    assert (unguided.generate(mouse, buttons, noise=noise) - made).abs().max() > 1e-3  # guidance moved it
    # with the mouse at rest the rest prediction is the prediction: guidance changes nothing
    rest = torch.zeros(2)
    assert torch.allclose(guided_pipe(cfg, model, 1.5, schedule).generate(rest, buttons, noise=noise),
                          guided_pipe(cfg, model, 1.0, schedule).generate(rest, buttons, noise=noise), atol=1e-5)


def test_guidance_one_makes_no_extra_call_and_can_change_between_frames():
    cfg = tiny_config()
    pipe = guided_pipe(cfg, random_model(cfg), 1.0)
    calls = pipe.lifecycle.model_calls
    pipe.generate(torch.tensor([2.0, 0.0]), torch.zeros(11))
    assert pipe.lifecycle.model_calls - calls == 2
    pipe.guidance = 2.0  # the lifecycle counts the rest call from the next frame on
    pipe.generate(torch.tensor([2.0, 0.0]), torch.zeros(11))
    assert pipe.lifecycle.model_calls - calls == 5
    for bad in (-0.5, 9.0, float("nan"), "1.5"):
        with pytest.raises(ValueError, match="guidance"):
            pipe.guidance = bad
    assert pipe.guidance == 2.0


def test_the_config_carries_guidance_and_refuses_a_bad_one(tmp_path):
    text = (REPO / "configs" / "untrained_tiny.yaml").read_text()
    assert "guidance" not in text
    assert load_config(REPO / "configs" / "untrained_tiny.yaml").pipeline.guidance == 1.0
    (tmp_path / "g.yaml").write_text(text.replace("pipeline:\n", "pipeline:\n  guidance: 1.5\n", 1))
    assert load_config(tmp_path / "g.yaml").pipeline.guidance == 1.5
    for bad in ("-1", "twice", "[1.5]", "100"):
        (tmp_path / "b.yaml").write_text(text.replace("pipeline:\n", f"pipeline:\n  guidance: {bad}\n", 1))
        with pytest.raises(ConfigError, match=r"b.yaml: pipeline.guidance="):
            load_config(tmp_path / "b.yaml")


def test_a_snapshot_loads_only_under_the_guidance_it_was_taken_with():
    cfg = tiny_config()
    model = random_model(cfg)
    guided, plain = guided_pipe(cfg, model, 1.5), guided_pipe(cfg, model, 1.0)
    state = guided.get_state()
    with pytest.raises(ValueError, match="other model or settings"):
        plain.load_state(state)
    again = guided_pipe(cfg, model, 1.5)
    again.load_state(state)
    assert torch.equal(again.generate(torch.ones(2), torch.zeros(11)), guided.generate(torch.ones(2), torch.zeros(11)))
    assert "guidance=1.5" in startup_text(guided, 0) and "guidance" not in startup_text(plain, 0)


@pytest.mark.parametrize("app", ["inference.game_cv", "inference.serve"])
@pytest.mark.parametrize("value", ["9", "-1", "nan"])
def test_the_apps_refuse_a_guidance_out_of_range(app, value, capsys):
    import importlib

    module = importlib.import_module(app)
    with pytest.raises(SystemExit):
        module.parse_args(["--guidance", value])
    err = capsys.readouterr().err
    assert f"--guidance {float(value):g}: must be a number in [0, 8]" in err
