import json
import subprocess
import sys

import pytest

from dlo.cli.main import main


def test_demo_console_script_reports_bit_identical(tmp_path):
    trace = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "dlo.cli.main", "demo", "--device", "cpu", "--steps", "3", "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "outputs: bit-identical over 3 steps" in done.stdout
    for row in ("time per step", "device weight memory", "bytes streamed per step", "H2D rate"):
        assert row in done.stdout
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_demo_with_options(model, capsys):
    assert main(["demo", "--model", model, "--device", "cpu", "--steps", "2", "--num-slots", "3", "--resident-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical" in out and "(+1 resident)" in out


def test_invalid_config_flag_is_a_clear_error(capsys):
    assert main(["demo", "--device", "cpu", "--num-slots", "1"]) == 2
    assert "OffloadConfig.num_slots must be >= 2" in capsys.readouterr().err


def test_bad_device_is_a_clear_error(capsys):
    assert main(["demo", "--device", "xla"]) == 2
    assert "'xla' is not supported" in capsys.readouterr().err
    assert main(["demo", "--device", "tpu"]) == 2
    assert "device='tpu' is not a device" in capsys.readouterr().err


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


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--num-slots", "--resident-layers", "--pin-memory", "--no-pin-memory", "--record-timeline"):
        assert flag in out


def test_demo_from_a_temporary_checkpoint(capsys):
    assert main(["demo", "--model", "flux", "--device", "cpu", "--steps", "2", "--from-checkpoint"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical" in out and "checkpoint_mmap" in out and "shared read-only" in out


def test_demo_writes_then_reuses_a_checkpoint_dir(tmp_path, capsys):
    directory = tmp_path / "ckpt"
    for _ in range(2):  # first call writes the checkpoint, second maps the existing one
        assert main(["demo", "--model", "wan", "--device", "cpu", "--steps", "2", "--from-checkpoint", str(directory)]) == 0
        assert "bit-identical" in capsys.readouterr().out
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


def test_demo_across_two_gloo_ranks():
    done = subprocess.run(
        [sys.executable, "-m", "dlo.cli.main", "demo", "--model", "flux", "--device", "cpu", "--steps", "2", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "all-gather across 2 ranks (gloo)" in done.stdout
    assert done.stdout.count("bit-identical") == 2


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


def test_nproc_refuses_options_it_does_not_run(capsys):
    assert main(["demo", "--device", "cpu", "--nproc", "2", "--trace", "t.json"]) == 2
    assert "does not take --trace or --from-checkpoint" in capsys.readouterr().err


def test_demo_through_a_registered_cache_says_so(tmp_path, monkeypatch, capsys):
    from fake_driver import FakeDriver

    from dlo.backend import cuda_registration

    monkeypatch.setattr(cuda_registration, "registration_driver", lambda device: FakeDriver())
    args = ["demo", "--model", "wan", "--device", "cpu", "--steps", "2", "--from-checkpoint", "--host-weight-cache"]
    assert main([*args, "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "mapped shared read-only, registered: direct copies" in capsys.readouterr().out
