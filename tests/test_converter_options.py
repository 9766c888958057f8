"""`dlo.load_transformer(FILE, converter_options=...)`: options of diffusers' single-file converter
that a file cannot tell, here MiniMax-H3's `qkv_layout` (its fused q/k/v rows stacked, or
interleaved head by head), reach the converter on every path; an option it does not take is
refused in one line. See [Note: single files through diffusers' converter]."""

import logging

import pytest
import torch

import dlo
from dlo.host.safetensors_file import SafetensorsFile
from dlo.host.single_file_layout import converted_layout
from dlo.models.tiny import TINY_MODELS
from single_file_layouts import minimax_h3_original
from test_single_file_mapping import random_model, write

diffusers = pytest.importorskip("diffusers")
MiniMax = pytest.importorskip("diffusers").MiniMaxH3Transformer3DModel

HEADS, HEAD_DIM = 2, 16
MINIMAX = dict(
    num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, hidden_size=HEADS * HEAD_DIM, num_layers=2,
    num_refiner_layers=1, ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=8, freq_dim=16,
    time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=4,
)


def minimax_file(tmp_path, qkv_layout: str):
    model = random_model(MiniMax, MINIMAX, torch.float32)
    path, config_dir = write(
        tmp_path, f"minimax-{qkv_layout}", model, lambda state: minimax_h3_original(state, HEADS, HEAD_DIM, qkv_layout)
    )
    return model, path, config_dir


def differing(model, expected) -> list[str]:
    got = model.state_dict()
    return [name for name, tensor in expected.state_dict().items() if not torch.equal(got[name], tensor)]


@pytest.mark.parametrize("qkv_layout", ["stacked", "interleaved"])
def test_the_option_reaches_the_converter_and_the_weights_are_the_models(tmp_path, caplog, qkv_layout):
    """A file written with either row order loads to exactly the model it was written from when
    the option says which; the gated MLP's swap (a `cat`) makes block tensors diffusers computes,
    so the load falls back to diffusers' single-file loader, and the option must reach it too."""
    expected, path, config_dir = minimax_file(tmp_path, qkv_layout)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        model, plan = dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": qkv_layout})
    assert plan is None and "checkpoint_plan_incompatible" in caplog.text
    assert differing(model, expected) == []
    # The rows read the other way: every block's q, k and v come out wrong (so the option did matter).
    other = "stacked" if qkv_layout == "interleaved" else "interleaved"
    misread, _ = dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": other})
    assert {name.rsplit(".", 2)[-2] for name in differing(misread, expected)} == {"to_q", "to_k", "to_v"}


def test_a_file_left_to_the_default_reads_stacked_rows(tmp_path):
    expected, path, config_dir = minimax_file(tmp_path, "stacked")
    model, _ = dlo.load_transformer(path, model_config=config_dir)
    assert differing(model, expected) == []


def test_the_option_reaches_the_provenance_run(tmp_path):
    """The mapped preflight runs the converter with the option too: stacked rows are ranges of
    the file (mapped); interleaved ones are strided views of it (computed)."""
    _, path, config_dir = minimax_file(tmp_path, "stacked")
    config = dict(MiniMax.load_config(config_dir))
    names = set(random_model(MiniMax, MINIMAX, torch.float32).state_dict())
    file = SafetensorsFile(path)
    try:
        stacked = converted_layout(file, MiniMax, config, names, {"qkv_layout": "stacked"})
        interleaved = converted_layout(file, MiniMax, config, names, {"qkv_layout": "interleaved"})
    finally:
        file.close()
    q = "transformer_blocks.0.attn.to_q.weight"
    assert q in stacked.entries and q not in stacked.computed
    assert q in interleaved.computed and q not in interleaved.entries
    assert interleaved.computed[q] == {"blocks.0.attn.qkv_proj.weight"}


def test_an_option_the_converter_does_not_take_is_refused_naming_the_ones_it_does(tmp_path):
    _, path, config_dir = minimax_file(tmp_path, "stacked")
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_order": "interleaved"})
    assert str(refused.value) == (
        "converter_options 'qkv_order': diffusers' single-file converter for MiniMaxH3Transformer3DModel takes qkv_layout"
    )


def test_a_value_the_converter_refuses_is_one_line_naming_the_file(tmp_path):
    _, path, config_dir = minimax_file(tmp_path, "stacked")
    with pytest.raises(dlo.ConfigError, match=r"cannot read it \(`qkv_layout` must be \"stacked\" or \"interleaved\""):
        dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": "rows"})


def test_options_for_a_converter_that_takes_none_or_for_a_directory_are_refused(tmp_path):
    entry = TINY_MODELS["wan"]
    model = entry.build(seed=2)
    path, config_dir = write(tmp_path, "wan", model, dict)
    with pytest.raises(dlo.ConfigError, match="converter for WanTransformer3DModel takes no options"):
        dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": "stacked"})
    model.save_pretrained(tmp_path / "wan-dir")
    with pytest.raises(dlo.ConfigError, match="wan-dir is a directory in diffusers' layout"):
        dlo.load_transformer(tmp_path / "wan-dir", converter_options={"qkv_layout": "stacked"})


def test_the_command_line_passes_the_options_to_the_loader(tmp_path):
    """`--converter-option` pairs reach dlo.load_transformer through the loader `dlo generate`
    and each `dlo serve` replica run for `--transformer FILE` (the pipeline's config of it)."""
    from dlo.pipelines.single_file import load_single_file

    expected, path, config_dir = minimax_file(tmp_path, "interleaved")
    model_dir = tmp_path / "pipeline"
    model_dir.mkdir()
    config_dir.rename(model_dir / "transformer")
    options = (("qkv_layout", "interleaved"),)
    model, _ = load_single_file(path, model_dir, torch.float32, dlo.OffloadConfig(), "--transformer", options)
    assert differing(model, expected) == []
    with pytest.raises(dlo.ConfigError, match=r"^--transformer converter_options 'layout'"):
        load_single_file(path, model_dir, torch.float32, dlo.OffloadConfig(), "--transformer", (("layout", "x"),))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_command_line_refuses_an_option_it_cannot_pass_before_loading(tiny_flux_dir, tmp_path, capsys, command):
    from test_generate import flags

    from dlo.cli.main import main

    if command == "serve":
        pytest.importorskip("fastapi")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    path, _ = write(tmp_path, "flux", transformer, dict)
    out = tmp_path / "x.png"
    if command == "generate":
        argv = ["generate", str(tiny_flux_dir), "--prompt", "a cube", "--device", "cpu", *flags("flux"), "--output", str(out)]
    else:
        argv = ["serve", str(tiny_flux_dir), "--device", "cpu", "--no-host-weight-cache"]
    for given, says in [
        (["--converter-option", "qkv_layout=stacked"], "--converter-option passes options to the single-file converter of "
         "--transformer FILE; give one"),
        (["--transformer", str(path), "--converter-option", "qkv_layout=stacked"], "--converter-option 'qkv_layout': "
         "diffusers' single-file converter for FluxTransformer2DModel takes no options"),
        (["--transformer", str(path), "--converter-option", "a=1", "--converter-option", "a=2"], "--converter-option a=...: "
         "given twice; give each KEY once"),
    ]:
        assert main([*argv, *given]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dlo: error: {says}"]
    with pytest.raises(SystemExit):
        main([*argv, "--transformer", str(path), "--converter-option", "qkv_layout"])
    assert "'qkv_layout': give KEY=VALUE, e.g. qkv_layout=interleaved" in capsys.readouterr().err
    assert not out.exists()
