"""`dlo.load_transformer(FILE, converter_options=...)`: options of diffusers' single-file converter
that a file cannot tell, here MiniMax-H3's `qkv_layout` (its fused q/k/v rows stacked, or
interleaved head by head), reach the converter on every path; an option it does not take is
refused in one line. MiniMax-H3's converter also swaps its gated MLP's halves (a `cat` of two
ranges of the file), streamed from the mapping as a concatenation. See [Note: single files
through diffusers' converter]."""

import logging

import pytest
import torch
from safetensors.torch import save_file

import dlo
from dlo.host.safetensors_file import SafetensorsFile
from dlo.host.single_file_layout import converted_layout
from dlo.models.tiny import TINY_MODELS, TinyModel, _wan_inputs
from ordinary_tensors import ordinary_tensors
from single_file_layouts import minimax_h3_original, wan_original
from test_single_file_mapping import random_model, write

diffusers = pytest.importorskip("diffusers")
MiniMax = pytest.importorskip("diffusers").MiniMaxH3Transformer3DModel

HEADS, HEAD_DIM = 2, 16
MINIMAX = dict(
    num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, hidden_size=HEADS * HEAD_DIM, num_layers=2,
    num_refiner_layers=1, ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=8, freq_dim=16,
    time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
)


def minimax_file(tmp_path, qkv_layout: str):
    model = random_model(MiniMax, MINIMAX, torch.float32)
    path, config_dir = write(
        tmp_path, f"minimax-{qkv_layout}", model, lambda state: minimax_h3_original(state, HEADS, HEAD_DIM, qkv_layout)
    )
    return model, path, config_dir


def minimax_inputs(seed: int) -> dict:
    """8 video rows, 4 text rows, 3 audio rows in one packed sequence, at two timesteps."""
    g = torch.Generator().manual_seed(seed)
    video, text, audio = 8, 4, 3
    rows = video + text + audio
    return dict(
        hidden_states=torch.randn(1, video, 16, generator=g), audio_hidden_states=torch.randn(1, audio, 4, generator=g),
        encoder_hidden_states=torch.randn(1, text, 8, generator=g), timestep=torch.tensor([0.3, 1.0]),
        timestep_indices=torch.tensor([0] * video + [1] * text + [0] * audio),
        token_tags=torch.tensor([0] * video + [1] * text + [2] * audio),
        position_ids=torch.stack([torch.zeros(rows, dtype=torch.long), torch.arange(rows) // 4, torch.arange(rows) % 4], 1),
        video_indices=torch.arange(video), text_indices=torch.arange(video, video + text),
        audio_indices=torch.arange(video + text, rows), return_dict=False,
    )


def outputs(model, plan=None) -> list[torch.Tensor]:
    """Video and audio outputs for two inputs: resident, or streamed by dlo with `plan`."""
    if plan is None:
        with torch.inference_mode():
            return [t for seed in (1, 2) for t in model(**minimax_inputs(seed))]
    with dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=2), plan=plan), torch.inference_mode():
        return [t for seed in (1, 2) for t in model(**minimax_inputs(seed))]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("qkv_layout", ["stacked", "interleaved"])
def test_the_option_reaches_the_converter_and_the_stream_equals_diffusers(tmp_path, caplog, qkv_layout):
    """A file written with either row order streams equal to diffusers' own single-file model
    given the same option, and to the model it was written from. Stacked rows are ranges of the
    file and stream from its mapping; interleaved ones are strided views of the fused tensor,
    which diffusers' loader computes (fallback), and the option must reach it too."""
    written, path, config_dir = minimax_file(tmp_path, qkv_layout)
    reference = MiniMax.from_single_file(str(path), config=str(config_dir), qkv_layout=qkv_layout).eval()
    expected = outputs(reference)
    assert equal(expected, outputs(written))
    with caplog.at_level(logging.WARNING, logger="dlo"):
        model, plan = dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": qkv_layout})
    if qkv_layout == "stacked":
        assert plan is not None and plan.backing == "checkpoint_mmap"
    else:
        assert plan is None and "'transformer_blocks.0.attn.to_q.weight'" in caplog.text
    assert equal(expected, outputs(model, plan))
    # The rows read the other way give other outputs: the comparison can fail.
    other = "stacked" if qkv_layout == "interleaved" else "interleaved"
    misread, plan = dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": other})
    assert not equal(expected, outputs(misread, plan))


def test_a_file_left_to_the_default_reads_stacked_rows(tmp_path):
    written, path, config_dir = minimax_file(tmp_path, "stacked")
    model, plan = dlo.load_transformer(path, model_config=config_dir)
    assert equal(outputs(written), outputs(model, plan))


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
    # The gated MLP's halves swapped ([gate; value] in the file): two ranges of it, value first.
    ff = "transformer_blocks.0.ff.net.0.proj.weight"
    fc1 = SafetensorsFile(path)
    try:
        whole = fc1.entries["blocks.0.mlp.fc1.weight"]
    finally:
        fc1.close()
    value, gate = (stacked.entries[part] for part in stacked.concatenated[ff])
    assert (value.begin, value.end, gate.begin, gate.end) == (
        whole.begin + whole.nbytes // 2, whole.end, whole.begin, whole.begin + whole.nbytes // 2
    )
    assert value.shape == gate.shape == (MINIMAX["ffn_dim"], MINIMAX["hidden_size"])


def test_an_option_the_converter_does_not_take_is_refused_naming_the_ones_it_does(tmp_path):
    _, path, config_dir = minimax_file(tmp_path, "stacked")
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_order": "interleaved"})
    assert str(refused.value) == (
        "converter_options 'qkv_order': diffusers' single-file converter for MiniMaxH3Transformer3DModel takes qkv_layout"
    )


def test_a_value_the_converter_refuses_is_one_line_naming_the_file(tmp_path):
    _, path, config_dir = minimax_file(tmp_path, "stacked")
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": "rows"})
    assert 'cannot read it (`qkv_layout` must be "stacked" or "interleaved"' in str(refused.value)
    assert "are converter_options={'qkv_layout': 'rows'} right for it" in str(refused.value)


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
    """`load_single_file` (what `dlo generate` and each `dlo serve` replica call for
    `--transformer FILE`, the pipeline's config of it) passes the options on."""
    from dlo.pipelines.single_file import load_single_file

    expected, path, config_dir = minimax_file(tmp_path, "interleaved")
    model_dir = tmp_path / "pipeline"
    model_dir.mkdir()
    config_dir.rename(model_dir / "transformer")
    options = (("qkv_layout", "interleaved"),)
    model, plan = load_single_file(path, model_dir, torch.float32, dlo.OffloadConfig(), "--transformer", options)
    assert equal(outputs(expected), outputs(model, plan))
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
        argv = ["serve", str(tiny_flux_dir), "--device", "cpu"]
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


@pytest.fixture
def wan_converter_with_an_option(monkeypatch):
    """diffusers' Wan converter given an option (as MiniMax-H3's has): `swap_qk="yes"` swaps the
    first block's q and k projections (renames: both stay ranges of the file)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]

    def converted(checkpoint, swap_qk="no", **kwargs):
        out = convert(checkpoint=checkpoint, **kwargs)
        if swap_qk == "yes":
            q, k = (f"blocks.0.attn1.to_{p}.weight" for p in "qk")
            out[q], out[k] = out[k], out[q]
        return out

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", entry)


def wan_files(tiny_wan_dir, tmp_path):
    """The tiny pipeline's transformer in Wan's own layout, and the same with the first block's q
    and k swapped in the file itself."""
    from single_file_layouts import wan_original

    state = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").state_dict()
    swapped = dict(state)
    q, k = (f"blocks.0.attn1.to_{p}.weight" for p in "qk")
    swapped[q], swapped[k] = state[k], state[q]
    paths = tmp_path / "wan.safetensors", tmp_path / "wan-swapped.safetensors"
    for path, weights in zip(paths, (state, swapped)):
        save_file({key: t.contiguous() for key, t in wan_original(weights).items()}, path)
    return paths


def test_generate_passes_converter_options_to_the_loader(tiny_wan_dir, tmp_path, wan_converter_with_an_option):
    """`dlo generate --transformer FILE --converter-option swap_qk=yes` streams the weights the
    option makes: the same video as the file with those weights written in it."""
    from test_generate import flags

    from dlo.cli.main import main

    path, swapped_path = wan_files(tiny_wan_dir, tmp_path)
    argv = ["generate", str(tiny_wan_dir), "--prompt", "a cat", "--device", "cpu", *flags("wan")]
    videos = {}
    for name, given in [
        ("option", [str(path), "--converter-option", "swap_qk=yes"]),
        ("no option", [str(path)]),
        ("swapped file", [str(swapped_path)]),
    ]:
        out = tmp_path / f"{name}.webp"  # lossless: the frames as generated
        assert main([*argv, "--output", str(out), "--transformer", *given]) == 0
        videos[name] = out.read_bytes()
    assert videos["option"] == videos["swapped file"] != videos["no option"]


def test_serve_gives_each_replica_the_converter_options(tiny_wan_dir, tmp_path, monkeypatch, wan_converter_with_an_option):
    """What `dlo serve` hands its replicas carries the options, and a replica's load applies them:
    its transformer computes what diffusers' own single-file model with the option does."""
    pytest.importorskip("fastapi")
    import dlo.serve.server
    from dlo.cli.main import main
    from dlo.serve.replica import _load

    path, _ = wan_files(tiny_wan_dir, tmp_path)
    served = []
    monkeypatch.setattr(dlo.serve.server, "serve", lambda server, text: served.append(server))
    argv = ["serve", str(tiny_wan_dir), "--device", "cpu", "--transformer", str(path), "--converter-option", "swap_qk=yes"]
    assert main(argv) == 0
    (replica,) = served[0].replicas
    assert replica.converter_options == (("swap_qk", "yes"),)
    assert replica.config.host_weight_cache  # on, as for MODEL's own transformer: a file that cannot be mapped uses it
    reference = diffusers.WanTransformer3DModel.from_single_file(
        str(path), config=str(tiny_wan_dir / "transformer"), swap_qk="yes"
    ).eval()
    ordinary_tensors(reference)
    pipe, handle = _load(replica)
    try:
        config = reference.config
        latent, text = (1, config.in_channels, 2, 8, 8), (1, 12, config.text_dim)
        inputs = TinyModel("pipeline-wan", "WanTransformer3DModel", dict(config), _wan_inputs(latent, text)).inputs(1)
        with torch.inference_mode():
            assert torch.equal(pipe.transformer(**inputs)[0], reference(**inputs)[0])
    finally:
        handle.disable()


def test_dlo_inspect_says_whether_a_single_file_streams_from_its_mapping(tmp_path, capsys):
    """`dlo inspect FILE --model-config DIR`: the preflight dlo.load_transformer runs, before
    anything loads: mapped (and with which adapters), or the fallback; with a budget, the
    blocks enable() reads from disk. The flags that need the config are refused without it."""
    from dlo.cli.main import main

    _, stacked, config_dir = minimax_file(tmp_path, "stacked")
    assert main(["inspect", str(stacked), "--model-config", str(config_dir)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint mmap:      yes" in out and "(adapters: 2 concat)" in out  # the gated MLP's swapped halves
    assert main(["inspect", str(stacked), "--model-config", str(config_dir), "--converter-option", "qkv_layout=interleaved"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint mmap:      no, falls back to the ordinary loader (checkpoint_plan_incompatible" in out
    budget = 0.5 * stacked.stat().st_size / 2**30
    assert main(["inspect", str(stacked), "--model-config", str(config_dir), "--host-budget-gib", str(budget)]) == 0
    shown = capsys.readouterr().out.split("read from disk:", 1)[1].splitlines()[0].strip().split(", ")
    model, plan = dlo.load_transformer(stacked, model_config=config_dir)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget), plan=plan) as handle:
        assert list(handle.stats().disk.blocks) == shown
    assert main(["inspect", str(stacked), "--model-config", str(config_dir), "--host-budget-gib", "1e-9"]) == 2
    captured = capsys.readouterr()  # a budget too small: one line, not the file's table first
    assert captured.out == "" and "raise it to at least" in captured.err
    for argv, says in [
        ([str(stacked), "--host-budget-gib", "1"], "--host-budget-gib: inspecting a single file's plan needs its model's"),
        ([str(stacked), "--num-slots", "3"], "--num-slots: inspecting a single file's plan needs its model's config"),
        ([str(stacked), "--dtype", "bfloat16"], "--dtype: inspecting a single file's plan needs its model's config"),
        ([str(tmp_path / "absent.safetensors"), "--model-config", str(config_dir)], "absent.safetensors: no such file"),
        ([str(stacked), "--model-config", str(config_dir), "--hbm-budget-gib", "10"], "is a single file"),
        ([str(stacked), "--converter-option", "qkv_layout=stacked"], "--converter-option: inspecting a single file's"),
        ([str(config_dir), "--model-config", str(config_dir)], "--model-config is for a .gguf or single-file"),
        ([str(stacked), "--model-config", str(config_dir), "--converter-option", "rows=1"], "takes qkv_layout"),
    ]:
        assert main(["inspect", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


@pytest.fixture
def wan_converter_with_typed_options(monkeypatch):
    """diffusers' Wan converter given a bool option and an int one (as UNet's `extract_ema`):
    what each run of it was given is recorded."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = dict(SINGLE_FILE_LOADABLE_CLASSES["WanTransformer3DModel"])
    convert = entry["checkpoint_mapping_fn"]
    given = []

    def converted(checkpoint, swap_qk=False, times=1, **kwargs):
        given.append((swap_qk, times))
        out = convert(checkpoint=checkpoint, **kwargs)
        if swap_qk:
            q, k = (f"blocks.0.attn1.to_{p}.weight" for p in "qk")
            out[q], out[k] = out[k], out[q]
        return out

    entry["checkpoint_mapping_fn"] = converted
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES, "WanTransformer3DModel", entry)
    return given


@pytest.mark.parametrize(
    ("options", "reaches"),
    [
        ({"swap_qk": "false", "times": "3"}, (False, 3)),  # as a command line gives them
        ({"swap_qk": "True"}, (True, 1)),
        ({"swap_qk": False, "times": 2}, (False, 2)),
    ],
)
def test_an_option_is_read_as_the_type_of_its_default(tmp_path, wan_converter_with_typed_options, options, reaches):
    """A string given for a bool option is true or false as it says ("false" is not a true
    string), one for an int option is the number: the converter gets what was meant."""
    from dlo.cli.main import main

    model = TINY_MODELS["wan"].build(seed=2)
    path, config_dir = write(tmp_path, "wan", model, wan_original)  # Wan's own layout: diffusers' needs no converter
    for config in (dlo.OffloadConfig(), dlo.OffloadConfig(checkpoint_mmap=False)):  # diffusers' own loader too
        dlo.load_transformer(path, config, model_config=config_dir, converter_options=options)
        assert set(wan_converter_with_typed_options) == {reaches}
        wan_converter_with_typed_options.clear()
    flags = [arg for key, value in options.items() for arg in ("--converter-option", f"{key}={value}".replace("False", "false"))]
    assert main(["inspect", str(path), "--model-config", str(config_dir), *flags]) == 0
    assert set(wan_converter_with_typed_options) == {reaches}


def test_one_meaning_of_the_options_is_one_host_weight_cache_entry(tmp_path, wan_converter_with_typed_options):
    """Converted once through the host weight cache: the same options however they are written
    ("false", False, left to the default) map that entry without running diffusers' loader
    again; other values convert anew."""
    from dlo.host.cache.entry_store import EntryStore

    model = TINY_MODELS["wan"].build(seed=2)
    path, config_dir = write(tmp_path, "wan", model, wan_original)
    config = dlo.OffloadConfig(
        checkpoint_mmap=False, host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True
    )
    for options, converts in [
        ({"swap_qk": "false", "times": "1"}, True), ({"swap_qk": False}, False), ({}, False), ({"swap_qk": " TRUE "}, True),
        ({"swap_qk": True, "times": 1}, False),
    ]:
        dlo.load_transformer(path, config, model_config=config_dir, converter_options=options)
        assert bool(wan_converter_with_typed_options) == converts, options
        wan_converter_with_typed_options.clear()
    assert len(EntryStore(config.cache_dir).keys()) == 2


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"swap_qk": "no"}, "converter_options swap_qk='no': the converter takes true or false there (its default is False)"),
        ({"swap_qk": 1}, "converter_options swap_qk=1: the converter takes true or false there (its default is False)"),
        ({"times": "2.5"}, "converter_options times='2.5': the converter takes an int there (its default is 1)"),
    ],
)
def test_a_value_not_of_the_type_of_the_options_default_is_refused_before_the_converter_runs(
    tmp_path, wan_converter_with_typed_options, options, says
):
    model = TINY_MODELS["wan"].build(seed=2)
    path, config_dir = write(tmp_path, "wan", model, wan_original)
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir, converter_options=options)
    assert str(refused.value) == says
    assert wan_converter_with_typed_options == []


def test_a_value_of_another_type_than_a_string_default_reaches_the_converter_and_is_one_line(tmp_path):
    """Only a value of the default's own type equal to it is left out: another (an array, whose
    comparison has no truth value) reaches the converter, whose refusal is one line."""
    import numpy as np

    _, path, config_dir = minimax_file(tmp_path, "stacked")
    with pytest.raises(dlo.ConfigError) as refused:
        dlo.load_transformer(path, model_config=config_dir, converter_options={"qkv_layout": np.array([1, 2])})
    assert "\n" not in str(refused.value) and "diffusers' single-file converter for MiniMaxH3Transformer3DModel cannot read it" in str(refused.value)
