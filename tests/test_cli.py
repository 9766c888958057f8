import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import dlo
from dlo.cli.demo import denoise
from dlo.cli.main import main
from dlo.config import OffloadConfig
from dlo.models.tiny import TINY_MODELS


def assert_streamed_like_a_fresh_resident_run(saved_path, model: str, steps: int, prompt_seed: int = 1, rank=None):
    """The demo's saved streamed outputs equal a resident run this test computes itself (the
    demo's own verdict and its own resident run are not trusted)."""
    saved = torch.load(saved_path)["streamed"]
    streamed = saved if rank is None else saved[rank]
    entry = TINY_MODELS[model]
    expected = denoise(entry.build(seed=0), entry, steps, torch.float32, torch.device("cpu"), prompt_seed).outputs
    assert len(streamed) == steps
    assert all(torch.equal(got, want) for got, want in zip(streamed, expected))


def test_demo_streams_float8_weights_like_the_quantized_model_resident(tmp_path, capsys):
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "flux", "--device", "cpu", "--steps", "2", "--stream-dtype", "fp8", "--fp8-scale", "per_tensor"]
    assert main([*argv, "--save-outputs", str(saved)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host bytes by dtype +- +.*KiB float8_e4m3fn", out)
    assert re.search(r"float8 vs unquantized \(last step\) +- +relative L2 \d\.\d\de-0[2-4], cosine 0\.99", out)
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0)
    dlo.quantize_resident(model, dlo.OffloadConfig(stream_dtype="fp8", fp8_scale="per_tensor"))
    expected = denoise(model, entry, 2, torch.float32, torch.device("cpu"), 1).outputs
    assert all(torch.equal(got, want) for got, want in zip(torch.load(saved)["streamed"], expected))


def test_demo_runs_fp8_gemms_like_the_same_gemms_resident(tmp_path, capsys):
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "flux", "--device", "cpu", "--steps", "2", "--stream-dtype", "fp8", "--fp8-compute"]
    assert main([*argv, "--save-outputs", str(saved)]) == 2  # fp32 on the CPU: no Linear qualifies
    assert "flux in float32 has no Linear to run as an FP8 GEMM" in capsys.readouterr().err
    assert not saved.exists()
    assert main([*argv, "--dtype", "bfloat16", "--save-outputs", str(saved)]) == 0
    assert "bit-identical (the resident run has the same float8 weights and runs the same FP8 GEMMs)" in (
        capsys.readouterr().out
    )
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    dlo.quantize_resident(model, dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True))
    expected = denoise(model, entry, 2, torch.bfloat16, torch.device("cpu"), 1).outputs
    assert all(torch.equal(got, want) for got, want in zip(torch.load(saved)["streamed"], expected))


def test_demo_console_script_streams_what_the_resident_model_computes(tmp_path):
    trace, saved = tmp_path / "trace.json", tmp_path / "outputs.pt"
    done = subprocess.run(
        [sys.executable, "-m", "dlo.cli.main", "demo", "--model", "wan", "--device", "cpu", "--steps", "3",
         "--trace", str(trace), "--save-outputs", str(saved)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert_streamed_like_a_fresh_resident_run(saved, "wan", 3)
    for row in ("time per step", "device weight memory", "bytes streamed per step", "H2D rate"):
        assert row in done.stdout
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_demo_with_options(model, tmp_path, capsys):
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", model, "--device", "cpu", "--steps", "2", "--num-slots", "3", "--resident-layers", "1"]
    assert main([*argv, "--save-outputs", str(saved)]) == 0
    assert "(+1 resident)" in capsys.readouterr().out
    assert_streamed_like_a_fresh_resident_run(saved, model, 2)


def test_demo_with_automatic_residency_under_a_budget(tmp_path, capsys):
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "flux", "--device", "cpu", "--steps", "4", "--resident", "auto", "--hbm-budget-gib", "0.0005"]
    assert main([*argv, "--save-outputs", str(saved)]) == 0
    chosen = re.search(r"resident_layers='auto' +- +(\d+) blocks resident, (\d+) slots, budget 524\.29 KiB", capsys.readouterr().out)
    assert chosen and 0 < int(chosen.group(1)) < 5
    assert_streamed_like_a_fresh_resident_run(saved, "flux", 4)


def test_demo_bytes_per_step_are_a_steady_steps_not_the_measuring_call_and_residency_loads(capsys):
    """With every block made resident after the measuring call, a step streams nothing: the
    per-step figure says so (the run's total, measuring call and resident copies, beside it)."""
    argv = ["demo", "--model", "flux", "--device", "cpu", "--steps", "3", "--resident", "auto", "--hbm-budget-gib", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0 (+5 resident)" in out
    assert re.search(r"bytes streamed per step +- +0 B \([\d.]+ [KM]iB over the 3 steps\)", out), out
    assert re.search(r"H2D rate +- +n/a \(cpu\)", out), out


def test_a_budget_below_what_streaming_needs_is_one_line_from_the_demo_before_any_weight(capsys, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("a model was built before the budget was checked")

    monkeypatch.setattr(type(TINY_MODELS["flux"]), "build", no_weights)
    assert main(["demo", "--model", "flux", "--device", "cpu", "--resident", "auto", "--hbm-budget-gib", "0.0001"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "below the" in err and "raise hbm_budget_gib" in err


def test_inspect_and_demo_report_the_same_weight_bytes(capsys):
    assert main(["inspect", "flux"]) == 0
    inspected = re.search(r"blocks, (.+) of weights", capsys.readouterr().out).group(1)
    assert main(["demo", "--model", "flux", "--device", "cpu", "--steps", "1"]) == 0
    demoed = re.search(r"\), (.+) of weights", capsys.readouterr().out).group(1)
    # payload: every parameter and buffer once, without the 512-byte alignment padding
    model = TINY_MODELS["flux"].build()
    payload = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert inspected == demoed == f"{payload / 1024:.2f} KiB"


def test_invalid_config_flag_is_a_clear_error_naming_the_flag(capsys):
    assert main(["demo", "--device", "cpu", "--num-slots", "1"]) == 2
    assert capsys.readouterr().err == "dlo: error: --num-slots must be >= 2, got 1\n"


def test_bad_device_is_a_clear_error_naming_the_flag(capsys):
    assert main(["demo", "--device", "xla"]) == 2
    assert "dlo: error: --device xla: dlo streams to 'cuda' devices" in capsys.readouterr().err
    assert main(["demo", "--device", "tpu"]) == 2
    assert "dlo: error: --device tpu is not a device" in capsys.readouterr().err


def test_inspect_a_diffusers_class_at_full_size(capsys):
    assert main(["inspect", "WanTransformer3DModel", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "WanTransformer3DModel: 40 blocks" in out and "plan: declared" in out
    assert "670.23 MiB" in out  # one Wan-14B block in bf16, 512-byte aligned tensors


def test_inspect_a_model_directory(tmp_path, capsys):
    from dlo.models.tiny import TINY_MODELS

    TINY_MODELS["flux"].build().save_pretrained(tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text("{}")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FluxTransformer2DModel: 5 blocks" in out
    assert "transformer_blocks" in out and "single_transformer_blocks" in out


def test_inspect_unknown_target(tmp_path, capsys):
    assert main(["inspect", "NoSuchModel"]) == 2
    assert "neither a directory" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a diffusers model directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_help_lists_every_config_field(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for spec in dataclasses.fields(OffloadConfig):
        flag = "--" + spec.name.replace("_", "-")
        assert re.search(rf"^\s+{flag}\b", out, re.MULTILINE), flag
        if spec.type in (bool, "bool"):
            assert f"--no-{spec.name.replace('_', '-')}" in out


@pytest.mark.parametrize(("command", "shown"), [("generate", "False"), ("serve", "on, off with --fp8-compute")])
def test_help_shows_the_commands_own_default_of_the_host_weight_cache(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"shards are views of it) (default: {shown}) --cache-dir" in text
    assert "--fp8-skip FP8_SKIP" in text and "the flag once per pattern (default: none)" in text


def test_serve_turns_the_host_weight_cache_off_with_fp8_compute_unless_asked():
    """--fp8-compute quantizes the weights at enable() and takes no cache entry: its default
    (on) would refuse the pair, so it is off then; asked for, the pair is refused in one line."""
    from dlo.cli.flag_checks import serve_config
    from dlo.cli.main import build_parser

    serve = ["serve", "model", "--transformer", "model.gguf"]
    assert serve_config(build_parser().parse_args(serve)).host_weight_cache
    config = serve_config(build_parser().parse_args([*serve, "--fp8-compute", "--stream-dtype", "fp8"]))
    assert config.fp8_compute and not config.host_weight_cache
    with pytest.raises(dlo.ConfigError, match="set --no-host-weight-cache"):
        serve_config(build_parser().parse_args([*serve, "--fp8-compute", "--stream-dtype", "fp8", "--host-weight-cache"]))


def test_demo_from_a_temporary_checkpoint(tmp_path, capsys):
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "flux", "--device", "cpu", "--steps", "2", "--from-checkpoint", "--save-outputs", str(saved)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "checkpoint_mmap" in out and "shared read-only" in out
    assert_streamed_like_a_fresh_resident_run(saved, "flux", 2)


def test_demo_writes_then_reuses_a_checkpoint_dir(tmp_path, capsys):
    directory, saved = tmp_path / "ckpt", tmp_path / "outputs.pt"
    for _ in range(2):  # first call writes the checkpoint, second maps the existing one
        argv = ["demo", "--model", "wan", "--device", "cpu", "--steps", "2", "--from-checkpoint", str(directory)]
        assert main([*argv, "--save-outputs", str(saved)]) == 0
        assert_streamed_like_a_fresh_resident_run(saved, "wan", 2)
    assert main(["demo", "--model", "flux", "--device", "cpu", "--from-checkpoint", str(directory)]) == 2
    assert "holds a WanTransformer3DModel checkpoint" in capsys.readouterr().err


def test_inspect_reports_the_checkpoint_preflight(tmp_path, capsys):
    from dlo.models.tiny import TINY_MODELS

    TINY_MODELS["sd3"].build().save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint mmap:      yes" in out and "cast" in out
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path)]) == 0
    assert "no, falls back to the ordinary loader (unsupported_online_quantization" in capsys.readouterr().out


def test_demo_across_two_gloo_ranks(tmp_path, capsys, monkeypatch):
    """Two real rank processes in a real Gloo group; the command itself runs in-process (its
    process is what test_demo_console_script_streams_what_the_resident_model_computes runs),
    and its ranks fork from the tests' forkserver, which has imported torch and diffusers,
    instead of spawning interpreters that import them again (as tests/test_generate_ranks.py
    does; the spawn start method is the only difference, and the ranks do not depend on it)."""
    from dlo.cli import rank_launch

    from child_processes import child_context

    monkeypatch.setattr(rank_launch, "rank_context", child_context)
    saved = tmp_path / "outputs.pt"
    argv = ["demo", "--model", "flux", "--device", "cpu", "--steps", "2", "--nproc", "2", "--gather-chunk-mib", "0.03",
            "--save-outputs", str(saved)]
    assert main(argv) == 0, capsys.readouterr().err
    assert "all-gather across 2 ranks (gloo)" in capsys.readouterr().out
    for rank in range(2):  # each rank ran its own prompt
        assert_streamed_like_a_fresh_resident_run(saved, "flux", 2, prompt_seed=rank, rank=rank)


def test_malformed_config_json_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "config.json is not readable JSON" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("[1, 2]")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "config.json is not a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--steps", "0"], "must be at least 1"),
        (["demo", "--nproc", "0"], "must be at least 1"),
    ],
)
def test_out_of_range_counts_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_gather_chunk_size_without_ranks_is_refused_before_any_work(capsys):
    assert main(["demo", "--device", "cpu", "--gather-chunk-mib", "32"]) == 2
    err = capsys.readouterr().err
    assert "--gather-chunk-mib 32 sizes all-gather mode's collectives" in err and "set --use-allgather," in err


def test_nproc_refuses_options_it_does_not_run(tmp_path, capsys):
    assert main(["demo", "--device", "cpu", "--nproc", "2", "--trace", str(tmp_path / "t.json")]) == 2
    assert "does not take --trace or --from-checkpoint" in capsys.readouterr().err


def test_demo_through_a_registered_cache_says_so(tmp_path, monkeypatch, capsys):
    from fake_driver import FakeDriver

    from dlo.backend import cuda_registration

    monkeypatch.setattr(cuda_registration, "registration_driver", lambda device: FakeDriver())
    args = ["demo", "--model", "wan", "--device", "cpu", "--steps", "2", "--from-checkpoint", "--host-weight-cache"]
    assert main([*args, "--cache-dir", str(tmp_path / "cache"), "--save-outputs", str(tmp_path / "outputs.pt")]) == 0
    assert "mapped shared read-only, registered: direct copies" in capsys.readouterr().out
    assert_streamed_like_a_fresh_resident_run(tmp_path / "outputs.pt", "wan", 2)


@pytest.mark.parametrize("flag", ["--trace", "--save-outputs"])
def test_a_demo_output_that_fails_to_write_leaves_the_existing_file_as_it_was(tmp_path, monkeypatch, flag):
    """The trace and the saved outputs are written beside their path and renamed onto it: a
    write that fails halfway (here: the disk fills up) loses nothing and leaves nothing."""
    import errno

    import dlo.cli.demo as demo_module
    from dlo.backend.handle import OffloadHandle

    def fills_the_disk(path):
        with open(path, "w") as half:
            half.write("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    if flag == "--trace":
        monkeypatch.setattr(OffloadHandle, "export_trace", lambda handle, path: fills_the_disk(path))
    else:
        monkeypatch.setattr(demo_module.torch, "save", lambda value, path: fills_the_disk(path))
    existing = tmp_path / "previous-run"
    existing.write_text("previous run")
    with pytest.raises(OSError, match="No space left"):
        main(["demo", "--model", "flux", "--device", "cpu", "--steps", "1", flag, str(existing)])
    assert existing.read_text() == "previous run" and sorted(tmp_path.iterdir()) == [existing]


def test_a_device_budget_turns_on_expandable_segments_unless_the_allocator_is_configured(monkeypatch, capsys):
    """See [Note: allocator under a budget]: set before CUDA starts, the user's own settings kept."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert main(["inspect", "flux"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # no budget: the allocator as the user has it
    assert main(["inspect", "flux", "--resident", "auto", "--hbm-budget-gib", "1"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert main(["inspect", "flux", "--resident", "auto", "--hbm-budget-gib", "1"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")  # the name newer torch reads first
    assert main(["inspect", "flux", "--resident", "auto", "--hbm-budget-gib", "1"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    capsys.readouterr()
