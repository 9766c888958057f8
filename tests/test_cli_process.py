"""The `dlo` process as a user meets it: Ctrl-C, version, help, quiet output, models in the
Hugging Face cache, `dlo make-tiny`."""

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from dlo.cli.main import build_parser, main

DLO = [sys.executable, "-m", "dlo.cli.main"]


def interrupt_when(process: subprocess.Popen, ready, timeout_s: float = 240) -> str:
    """Send Ctrl-C (SIGINT to the whole process group, as a terminal does) once `ready()`; the
    process's stderr afterwards."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "never got ready"
        time.sleep(0.2)
    children = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    # multiprocessing's resource tracker ends on its own once its parent's pipe closes: give it a moment
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [c.pid for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    return stderr


def test_ctrl_c_during_generate_prints_one_line_exits_130_and_leaves_no_file(tiny_flux_dir, tmp_path):
    out = tmp_path / "out" / "cube.png"
    out.parent.mkdir()
    stderr_log = tmp_path / "stderr.txt"
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--steps", "5000", "--height", "32",
            "--width", "32", "--output", str(out)]
    with open(stderr_log, "w") as log:
        process = subprocess.Popen([*DLO, *argv], stderr=log, stdout=subprocess.PIPE, text=True, start_new_session=True)
        # the denoising loop's progress bar: the transformer is loaded and running
        interrupt_when(process, lambda: "/5000" in stderr_log.read_text())
    lines = stderr_log.read_text().replace("\r", "\n").strip().splitlines()
    assert process.returncode == 130
    assert lines[-1] == "dlo: interrupted" and "Traceback" not in stderr_log.read_text()
    assert list(out.parent.iterdir()) == []


def test_ctrl_c_across_two_ranks_ends_every_rank_in_one_line(tiny_flux_dir, tmp_path):
    """`dlo generate --nproc 2` (the launcher `dlo demo --nproc` shares): the ranks are ended
    (no leaked-lock report from their progress bars' locks), the last line is the parent's
    alone, nothing is left behind."""
    scratch, out = tmp_path / "tmp", tmp_path / "out"
    scratch.mkdir()
    out.mkdir()
    stderr_log = tmp_path / "stderr.txt"
    env = {**os.environ, "TMPDIR": str(scratch)}
    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--steps", "5000", "--height", "32",
            "--width", "32", "--nproc", "2", "--parallel", "sp", "--output", str(out / "cube.png")]
    with open(stderr_log, "w") as log:
        process = subprocess.Popen([*DLO, *argv], stderr=log, stdout=subprocess.PIPE, text=True, env=env,
                                   start_new_session=True)
        interrupt_when(process, lambda: "/5000" in stderr_log.read_text())  # rank 0 is denoising
    text = stderr_log.read_text()
    assert process.returncode == 130
    assert text.replace("\r", "\n").strip().splitlines()[-1] == "dlo: interrupted" and "Traceback" not in text
    assert "leaked" not in text
    assert list(scratch.iterdir()) == [] and list(out.iterdir()) == []  # no rendezvous directory, no partial file


def test_version(capsys):
    import dlo

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"dlo {dlo.__version__}\n"


def _options(command: str) -> set[str]:
    commands = next(a for a in build_parser()._actions if a.dest == "subcommand")
    return set(commands.choices[command]._option_string_actions)


def test_inspect_takes_only_flags_that_change_what_it_prints():
    assert _options("inspect") == {
        "-h", "--help", "-v", "--verbose", "--dtype", "--num-slots", "--resident-layers", "--resident",
        "--hbm-budget-gib", "--host-budget-gib", "--nproc", "--use-allgather", "--no-use-allgather", "--gather-chunk-mib",
        "--model-config", "--converter-option",
    }


def test_help_explains_prompt_and_seed(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--prompt PROMPT the text describing the image or video to generate" in text
    assert "--seed SEED seed of the initial noise, 0 to 18446744073709551615; same seed, same output (default: 0)" in text


@pytest.mark.parametrize("action", ["verify", "rm"])
def test_cache_help_explains_key(action, capsys):
    with pytest.raises(SystemExit):
        main(["cache", action, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "KEY an entry's key, or a unique prefix of it as `ls` shows" in text or (
        "KEY the entry's key, or a unique prefix of it as `ls` shows" in text
    )


@pytest.fixture
def hub_cache(tiny_flux_dir, tmp_path):
    """A Hugging Face cache laid out as the hub writes it, holding org/tiny-flux at revision
    `abc123`: files in blobs/ named by their hash, the snapshot made of relative symlinks to them."""
    repo = tmp_path / "hub" / "models--org--tiny-flux"
    (repo / "blobs").mkdir(parents=True)
    for source in sorted(p for p in tiny_flux_dir.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, blob)
        link = repo / "snapshots" / "abc123" / source.relative_to(tiny_flux_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return tmp_path / "hub"


def test_generate_a_hub_id_from_the_cache_offline_quietly_and_a_tmpfs_cache_dir_is_one_warning_never_made(
    hub_cache, tmp_path
):
    """One `dlo generate` process (formerly two tests, a process each, ~10 s each here) checks:
    (1) a hub id runs from the Hugging Face cache, offline; (2) quietly: progress bars only, no
    warnings, notices or deprecations from dlo's calls or other libraries, apart from (3) the
    host weight cache fallback, which is one line `WARNING dlo: ...` (not `WARNING
    dlo.host.cache.consume: dlo: ...`); and (4) the refused cache root on tmpfs, and its
    parents, are never made."""
    root = Path("/dev/shm") / f"dlo-test-{os.getpid()}-{tmp_path.name}"
    if not root.parent.is_dir():
        pytest.skip("no /dev/shm here")
    out = tmp_path / "cube.png"
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    argv = ["generate", "org/tiny-flux", "--prompt", "a red cube", "--device", "cpu", "--steps", "2", "--height", "32",
            "--width", "32", "--max-sequence-length", "32", "--guidance", "0", "--output", str(out),
            "--host-weight-cache", "--cache-dir", str(root / "cache")]
    done = subprocess.run([*DLO, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert Image.open(out).size == (32, 32)  # (1)
    # (3) the fallback: exactly one WARNING line, naming dlo alone
    (warning,) = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert warning.startswith("WARNING dlo: host weight cache fallback invalid_configuration: the cache root ")
    assert "is on tmpfs" in warning
    # (2) quiet: that line aside, progress bars only
    rest = done.stderr.replace(warning, "")
    for noise in ("Warning", "warning", "WARNING", "[transformers]", "torch_dtype", "deprecated",
                  "Loading pipeline components"):
        assert noise not in rest, noise
    assert not root.exists()  # (4)


def test_a_hub_id_not_in_the_cache_says_so_offline(hub_cache, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "org/absent", "--prompt", "x", "--output", "x.png"]) == 2
    assert capsys.readouterr().err == (
        f"dlo: error: MODEL org/absent: not in the Hugging Face cache {hub_cache} and HF_HUB_OFFLINE is set; download "
        "it first (`hf download org/absent`) or pass its directory\n"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert main(["generate", "org/absent", "--prompt", "x", "--output", "x.png", "--offline"]) == 2
    assert "and --offline was given" in capsys.readouterr().err
    assert main(["inspect", "org/tiny-flux"]) == 0  # found in the cache
    assert "FluxTransformer2DModel: 5 blocks" in capsys.readouterr().out


def test_generate_passes_diffusers_the_current_dtype_argument(tiny_flux_dir, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--steps", "1", "--height", "32",
                "--width", "32", "--output", str(tmp_path / "x.png"), "-v"]
        assert main(argv) == 0
    assert not [w for w in caught if "torch_dtype" in str(w.message)]


def test_make_tiny_writes_a_pipeline_that_its_suggested_command_runs(tmp_path, monkeypatch, capsys):
    directory = tmp_path / "tiny-wan"
    assert main(["make-tiny", "wan", str(directory)]) == 0
    command = capsys.readouterr().out.splitlines()[-1].removeprefix("try: ")
    monkeypatch.chdir(tmp_path)
    assert main([*shlex.split(command)[1:], "--device", "cpu"]) == 0
    frames = Image.open(tmp_path / "cat.gif")
    assert frames.n_frames == 5 and np.asarray(frames.convert("RGB")).std() > 0
    assert main(["make-tiny", "wan", str(directory)]) == 2  # never written over
    assert "exists and is not an empty directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("directory", "line"),
    [
        ("/proc/x", "DIR /proc/x: cannot be written (No such file or directory)"),
        ("{tmp}/a-file/x", "DIR {tmp}/a-file/x: a parent of it is a file, not a directory"),
        ("{tmp}/missing/x", "DIR {tmp}/missing/x: directory {tmp}/missing does not exist"),
    ],
    ids=["proc", "file-as-parent", "missing-parent"],
)
def test_make_tiny_where_nothing_can_be_written_is_one_line_and_exit_2(directory, line, tmp_path):
    (tmp_path / "a-file").write_text("")
    directory = directory.format(tmp=tmp_path)
    done = subprocess.run([*DLO, "make-tiny", "flux", directory], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"dlo: error: {line.format(tmp=tmp_path)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_ctrl_c_during_make_tiny_leaves_nothing_and_the_same_command_then_works_printing_no_bars(tmp_path):
    """The pipeline is written beside DIR and renamed onto it once complete. The second,
    complete run also checks what test_make_tiny_prints_no_bars_of_the_libraries_that_write_it
    checked in a process of its own (for wan; make-tiny quiets the libraries in one place,
    dlo.cli.make_tiny, for every kind): no "Writing model shards" bars, no notices."""
    directory = tmp_path / "tiny-flux"
    stderr_log = tmp_path / "stderr.txt"
    # The same CLI, with each saved model component followed by a long pause, so that the Ctrl-C
    # surely lands with a component on disk and the rest not (tiny components save in milliseconds).
    paused_after_each_component = (
        "import sys, time, diffusers\n"
        "save = diffusers.ModelMixin.save_pretrained\n"
        "def paused(self, *args, **kwargs):\n"
        "    save(self, *args, **kwargs)\n"
        "    time.sleep(600)\n"
        "diffusers.ModelMixin.save_pretrained = paused\n"
        "from dlo.cli.main import main\n"
        "sys.exit(main())\n"
    )
    with open(stderr_log, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", paused_after_each_component, "make-tiny", "flux", str(directory)],
                                   stderr=log, stdout=subprocess.PIPE, text=True, start_new_session=True)
        interrupt_when(process, lambda: any(tmp_path.glob(".tiny-flux.dlo-partial-*/*/config.json")))
    assert process.returncode == 130 and stderr_log.read_text().splitlines()[-1] == "dlo: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stderr.txt"]
    done = subprocess.run([*DLO, "make-tiny", "flux", str(directory)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no bars, no notices of the libraries that write it
    assert (directory / "model_index.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [
        "stderr.txt", "tiny-flux"
    ]


def test_quiet_output_hides_the_text_encoders_loading_bars_but_keeps_the_download_bar(tiny_flux_dir, tmp_path):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    argv = ["generate", str(tiny_flux_dir), "--prompt", "x", "--device", "cpu", "--steps", "1", "--height", "32",
            "--width", "32", "--output", str(tmp_path / "x.png")]
    from diffusers.utils import logging as diffusers_logging

    try:
        assert main(argv) == 0
        assert not transformers_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
        assert not diffusers_logging.is_progress_bar_enabled()  # "Loading pipeline components..."
    finally:
        transformers_logging.enable_progress_bar()
        enable_progress_bars()
        diffusers_logging.enable_progress_bar()


def test_a_command_that_loads_no_pipeline_does_not_import_transformers(tmp_path):
    """transformers takes seconds to import; only commands that load a pipeline's text encoders need it."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    script = (
        "import sys\n"
        "from dlo.cli.main import main\n"
        f"assert main(['cache', 'ls', '--cache-dir', {str(root)!r}]) == 0\n"
        "print(sorted(name for name in ('transformers', 'diffusers') if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_ctrl_c_while_the_command_line_is_still_importing_prints_one_line(tmp_path):
    """The command's first import of torch (after parsing) is held until Ctrl-C: the interrupt
    lands inside it and still ends with one line and 130, no traceback."""
    ready = tmp_path / "importing-torch"
    script = (
        "import sys, time\n"
        "class Stall:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'torch':\n"
        f"            open({str(ready)!r}, 'w').close()\n"
        "            time.sleep(600)\n"
        "sys.meta_path.insert(0, Stall())\n"
        "from dlo.cli.launch import main\n"
        "sys.exit(main())\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script, "inspect", "wan"], stderr=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    stderr = interrupt_when(process, ready.exists)
    assert process.returncode == 130
    assert stderr.splitlines() == ["dlo: interrupted"]


# Heavy libraries the command line must not import to parse, answer --help or refuse flags.
HEAVY = ("torch", "diffusers", "transformers", "numpy", "safetensors")


def test_help_version_and_flag_refusals_import_no_torch(tmp_path):
    """See [Note: parse before torch]: each of these, in one fresh process, leaves torch (and
    the other heavy libraries) unimported, with the status and the one line a user gets."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    out = str(tmp_path / "o.png")
    cases = [
        (["--help"], 0), (["--version"], 0),
        *[([command, "--help"], 0) for command in ("demo", "generate", "serve", "inspect", "make-tiny", "cache")],
        (["cache", "rm", "--help"], 0),
        (["demo", "--model", "nope"], 2),  # an invalid choice
        (["demo", "--steps", "0"], 2),  # a bounded number
        (["demo", "--num-slots", "1"], 2),  # OffloadConfig's own validation
        (["demo", "--nproc", "2", "--trace", str(tmp_path / "t.json")], 2),
        (["generate", "m", "--output", out], 2),  # --prompt missing
        (["generate", "m", "--prompt", "x", "--output", out, "--bogus-flag"], 2),
        (["generate", "m", "--prompt", "x", "--output", str(tmp_path / "o.mp3")], 2),
        (["generate", "m", "--prompt", "x", "--output", out, "--ulysses", "2"], 2),
        (["generate", "m", "--prompt", "x", "--output", str(tmp_path / "missing" / "o.png")], 2),
        (["serve", "m", "--port", "0"], 2),
        (["inspect", "wan", "--dtype", "float64"], 2),
        (["cache", "rm", ""], 2),
        (["cache", "rm", "abcdef01", "--timeout", "3"], 2),
        (["make-tiny", "flux", str(tmp_path / "full")], 2),
    ]
    script = (
        "import json, sys\n"
        "from dlo.cli.main import main\n"
        f"heavy = {HEAVY!r}\n"
        "report = []\n"
        f"for argv in {[argv for argv, _ in cases]!r}:\n"
        "    try:\n"
        "        status = main(argv)\n"
        "    except SystemExit as exited:\n"
        "        status = exited.code\n"
        "    report.append([status, [name for name in heavy if name in sys.modules]])\n"
        "print(json.dumps(report), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    report = json.loads(done.stderr.splitlines()[-1])
    refusals = [line for line in done.stderr.splitlines()[:-1] if line.startswith("dlo: error: ")]
    assert [(argv, status, imported) for (argv, _), (status, imported) in zip(cases, report)] == [
        (argv, status, []) for argv, status in cases
    ]
    assert len(refusals) == sum(status == 2 for _, status in cases)  # one line each


def test_the_console_command_answers_a_flag_refusal_without_importing_torch():
    """The console script (dlo.cli.launch), as PYTHONPROFILEIMPORTTIME shows it: no torch among
    the modules the process imported."""
    argv = ["generate", "m", "--prompt", "x", "--output", "o.png", "--bogus-flag"]
    console = "import sys; from dlo.cli.launch import main; sys.exit(main())"
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run([sys.executable, "-c", console, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "dlo.cli.main" in imported and not imported & set(HEAVY)
