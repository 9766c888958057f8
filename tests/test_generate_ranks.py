"""`dlo generate --nproc 2 --parallel sp|dp` across 2 real Gloo ranks on tiny local pipelines:
SP writes what diffusers' own context parallelism makes without dlo, DP one output per rank
equal to one process's with that rank's seed; every broken rule is refused before loading."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dlo
from dlo.cli import rank_launch
from dlo.cli.main import main
from dlo.pipelines.media_output import write_video

sys.path.insert(0, str(Path(__file__).parent))
import sequence_parallel_ranks  # noqa: E402  (the ranks import it by name)
from child_processes import child_context  # noqa: E402
from test_generate import flags  # noqa: E402

pytest.importorskip("diffusers")


@pytest.fixture
def forked_ranks(monkeypatch):
    """The command's ranks fork from the tests' server, which has imported torch, diffusers and
    the pipelines, instead of spawning interpreters that import them again (seconds each)."""
    monkeypatch.setattr(rank_launch, "rank_context", child_context)


def diffusers_sequence_parallel(directory, name, seed, tmp_path):
    """Rank 0's output of the pipeline under diffusers' Ulysses-2 context parallelism, no dlo."""
    context = child_context()
    results = context.Queue()
    rendezvous = str(tmp_path / "reference-rendezvous")
    ranks = [
        context.Process(target=sequence_parallel_ranks.reference_rank,
                        args=(rank, 2, rendezvous, str(directory), name, seed, results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        outputs = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert not any(isinstance(out, str) for out in outputs.values()), outputs
    return outputs[0]


def decoded(path):
    """Every frame of an image file, as RGB arrays (one for a PNG)."""
    frames = []
    with Image.open(path) as image:
        for index in range(getattr(image, "n_frames", 1)):
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


@pytest.mark.parametrize(("name", "suffix"), [("flux", ".png"), ("wan", ".gif")])
def test_sequence_parallel_generate_writes_what_diffusers_context_parallelism_makes(
    name, suffix, tiny_flux_dir, tiny_wan_dir, tmp_path, capsys, forked_ranks
):
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir}[name]
    out = tmp_path / f"out{suffix}"
    argv = ["generate", str(directory), "--prompt", "a red cube", "--device", "cpu", "--seed", "3", "--output", str(out),
            "--nproc", "2", "--parallel", "sp", "--ulysses", "2", *flags(name)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "sequence parallel across 2 ranks (ulysses 2 x ring 1)" in printed and printed.count("shards") == 2
    # The transformer's sequence really was split (Ulysses' output equals an unsplit run's here)
    assert "rank 0 (1/2 of the sequence)" in printed and "rank 1 (1/2 of the sequence)" in printed
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [out.name]  # rank 0 writes, alone
    expected = diffusers_sequence_parallel(directory, name, 3, tmp_path)
    if name == "flux":  # PNG: the pixels themselves
        assert np.array_equal(decoded(out)[0], np.asarray(expected))
    else:  # GIF: the same frames through the same encoder
        write_video(expected, tmp_path / "expected.gif", 16)
        assert np.array_equal(decoded(out), decoded(tmp_path / "expected.gif"))


def test_data_parallel_generate_under_a_host_budget_reads_each_ranks_shards_from_disk(
    tiny_flux_dir, tmp_path, capsys, forked_ranks
):
    """`--nproc 2 --host-budget-gib`: each rank keeps part of its shards and reads the others
    from the transformer's files, and writes what one process makes with its seed."""
    size = sum(f.stat().st_size for f in (tiny_flux_dir / "transformer").glob("*.safetensors"))
    budget = f"{0.3 * size / 2**30:.9f}"
    common = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", *flags("flux")]
    out = tmp_path / "cube.png"
    assert main([*common, "--seed", "5", "--nproc", "2", "--parallel", "dp", "--host-budget-gib", budget, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r"shards, [1-5] of 5 from disk", printed)) == 2
    assert main([*common, "--seed", "6", "--output", str(tmp_path / "single.png")]) == 0
    assert np.array_equal(decoded(tmp_path / "cube.rank1.png"), decoded(tmp_path / "single.png"))


def test_data_parallel_generate_writes_each_rank_what_one_process_makes_with_its_seed(
    tiny_flux_dir, tmp_path, capsys, forked_ranks
):
    common = ["generate", str(tiny_flux_dir), "--prompt", "a red cube", "--device", "cpu", *flags("flux")]
    assert main([*common, "--seed", "5", "--nproc", "2", "--parallel", "dp", "--output", str(tmp_path / "cube.png")]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'cube.rank0.png'} (seed 5)" in printed and f"wrote {tmp_path / 'cube.rank1.png'} (seed 6)" in printed
    assert printed.count("shards") == 2  # all-gather by default: each rank holds half the blocks
    for rank, seed in ((0, 5), (1, 6)):
        single = tmp_path / f"single{seed}.png"
        assert main([*common, "--seed", str(seed), "--output", str(single)]) == 0
        assert np.array_equal(decoded(tmp_path / f"cube.rank{rank}.png"), decoded(single))


@pytest.fixture
def sd3_dir(tmp_path):
    """Just enough of an SD3 pipeline directory for the checks before loading: its transformer
    class has no context-parallel plan."""
    directory = tmp_path / "sd3"
    (directory / "transformer").mkdir(parents=True)
    index = {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"]}
    (directory / "model_index.json").write_text(json.dumps(index))
    config = {"_class_name": "SD3Transformer2DModel", "num_attention_heads": 2, "patch_size": 2, "sample_size": 32}
    (directory / "transformer" / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("model", "given", "message"),
    [
        ("flux", ["--nproc", "2"], "--nproc 2: say how the ranks split the work, --parallel dp"),
        ("flux", ["--parallel", "dp"], "--parallel dp needs --nproc N with N >= 2 ranks"),
        ("flux", ["--nproc", "2", "--parallel", "dp", "--ulysses", "2"], "--ulysses 2: the degrees of sequence parallelism need --parallel sp"),
        ("flux", ["--ring", "2"], "--ring 2: the degrees of sequence parallelism need --parallel sp"),
        ("flux", ["--nproc", "2", "--parallel", "sp", "--ulysses", "3"], "--ulysses 3: the sequence-parallel degrees multiply to 3, not --nproc 2"),
        ("flux", ["--nproc", "4", "--parallel", "sp", "--ulysses", "2", "--ring", "3"], "multiply to 6, not --nproc 4"),
        ("flux", ["--nproc", "2", "--parallel", "dp", "--device", "cpu:0"], "--device cpu:0: with --nproc each rank takes its own device"),
        ("flux", ["--nproc", "4", "--parallel", "sp"], "Ulysses over 4 ranks (--ulysses, default --nproc): FluxTransformer2DModel has 2 attention heads"),
        ("flux", ["--nproc", "2", "--parallel", "sp", "--max-sequence-length", "31"], "--max-sequence-length 31: FluxTransformer2DModel splits the text tokens across the 2 ranks too; use a multiple of 2"),
        ("wan", ["--nproc", "2", "--parallel", "sp", "--ring", "2"], "--ring 2: ring attention merges partial results by their log-sum-exp"),
        ("sd3", ["--nproc", "2", "--parallel", "sp"], "--parallel sp: SD3Transformer2DModel (transformer) has no context-parallel plan"),
    ],
)
def test_parallel_rules_are_refused_in_one_line_before_loading(model, given, message, tiny_flux_dir, tiny_wan_dir, sd3_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dlo, "load_transformer", None)  # refused before any weight loads
    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    directory = {"flux": tiny_flux_dir, "wan": tiny_wan_dir, "sd3": sd3_dir}[model]
    sizes = flags(model) if model != "sd3" else []
    suffix = ".gif" if model == "wan" else ".png"
    argv = ["generate", str(directory), "--prompt", "x", "--device", "cpu", *sizes, *given, "--output", str(tmp_path / f"a{suffix}")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dlo: error: ") and message in err and err.count("\n") == 1


def test_a_sequence_the_ranks_cannot_split_evenly_is_refused_naming_the_size(tiny_wan_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dlo, "load_transformer", None)
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "_native_cudnn")  # one ring attention can use: the size is refused
    argv = ["generate", str(tiny_wan_dir), "--prompt", "x", "--device", "cpu", *flags("wan"), "--nproc", "3",
            "--parallel", "sp", "--ring", "3", "--output", str(tmp_path / "a.gif")]
    assert main(argv) == 2
    assert "--height/--width/--frames 32x32x5: 8 transformer tokens do not split evenly across 3 ranks" in capsys.readouterr().err


def test_the_first_failed_rank_ends_the_others(forked_ranks):
    import launched_ranks

    reports = rank_launch.launch_ranks(launched_ranks.one_rank_fails, None, 2, "cpu", timeout_s=60)
    assert list(reports) == [1] and "RuntimeError: rank 1 broke" in reports[1]["error"]  # rank 0 was ended, not awaited


def test_a_rank_that_dies_without_a_word_is_reported(forked_ranks):
    import launched_ranks

    reports = rank_launch.launch_ranks(launched_ranks.one_rank_dies, None, 2, "cpu", timeout_s=60)
    assert reports[1] == {"error": "ended with status 3 without reporting"} and reports[0] == {"ok": True}
