"""`dlo serve` before it serves: the port is bound before any replica starts (a port it cannot
listen on is one line, status 2), SIGTERM while the replicas load stops them, and a replica
whose server is killed while it loads exits rather than loading on."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlo.cli.main import main
from serve_process import free_port


@pytest.fixture
def replicas_never_start(monkeypatch):
    import dlo.serve.server

    def started(*args, **kwargs):
        raise AssertionError("the replicas started before the port was bound")

    monkeypatch.setattr(dlo.serve.server, "ReplicaPool", started)


@pytest.mark.parametrize("where", ["port-in-use", "host-not-here"])
def test_a_port_it_cannot_listen_on_is_refused_before_the_replicas_start(
    where, tiny_flux_dir, replicas_never_start, capsys
):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # 192.0.2.1: TEST-NET-1 (RFC 5737), an address of no machine here.
        host = "127.0.0.1" if where == "port-in-use" else "192.0.2.1"
        status = main(["serve", str(tiny_flux_dir), "--device", "cpu", "--host", host, "--port", str(port)])
    lines = capsys.readouterr()
    errors = lines.err.strip().splitlines()
    assert status == 2 and len(errors) == 1 and not lines.out, lines
    why = "Address already in use" if where == "port-in-use" else "Cannot assign requested address"
    assert errors[0] == (
        f"dlo: error: --host {host} --port {port}: cannot serve there ({why}); give a free --port, "
        "or a --host address of this machine"
    )


def _session(leader: int) -> list[int]:
    """The live processes of the session `leader` started (its replicas and their helpers stay
    in it when it dies), the leader itself left out."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != leader:
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[3]) == leader and fields[0] != "Z":  # the session id; not a zombie
                pids.append(int(entry.name))
    return pids


def _replica_pids(leader: int) -> list[int]:
    pids = []
    for pid in _session(leader):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


def _serve(pipeline_dir, tmp_path, log, port: int = 0) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "dlo.cli.main", "serve", str(pipeline_dir), "--device", "cpu",
        "--port", str(port or free_port()), "--cache-dir", str(tmp_path / "cache"), "--cache-allow-any-filesystem",
    ]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _imports_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _stopped_replica(process: subprocess.Popen) -> int:
    """The server's first replica, stopped (SIGSTOP) once it is importing torch: past its
    start-up data (which the server writes right after starting it: stopped or cut off before,
    it would exit on an empty pipe, not load), and however fast the machine, still loading."""
    deadline = time.monotonic() + 120
    while not (replicas := [pid for pid in _replica_pids(process.pid) if _imports_torch(pid)]):
        assert process.poll() is None and time.monotonic() < deadline, "no replica started"
        time.sleep(0.02)
    os.kill(replicas[0], signal.SIGSTOP)
    return replicas[0]


def test_sigterm_while_the_replicas_load_stops_them(tiny_flux_dir, tmp_path):
    """While the replicas load, the port is bound but refuses connections (a client is not
    left waiting through the load). SIGTERM then: the server exits as interrupted (130), and
    no process it started is left (a stopped orphan never finishes loading by itself)."""
    port = free_port()
    with open(tmp_path / "serve.log", "w+") as log:
        process = _serve(tiny_flux_dir, tmp_path, log, port)
        left: list[int] = []
        try:
            _stopped_replica(process)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
            with pytest.raises(OSError, match="Address already in use"), socket.socket() as other:
                other.bind(("127.0.0.1", port))  # bound all the same: the port is the server's
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=60)
            deadline = time.monotonic() + 30
            while (left := _session(process.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            log.seek(0)
            assert status == 130 and not left, log.read()
        finally:
            for pid in left or _session(process.pid):  # the ones this test's server started
                os.kill(pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()


def test_a_replica_whose_server_is_killed_while_it_loads_exits_without_loading_on(tiny_flux_dir, tmp_path):
    """SIGKILL leaves the server no chance to stop its replicas: the one it was loading (held
    stopped until the server is gone) must notice by itself, say so, and exit, instead of
    finishing the load and failing to report it (a BrokenPipeError)."""
    with open(tmp_path / "serve.log", "w+") as log:
        process = _serve(tiny_flux_dir, tmp_path, log)
        try:
            replica = _stopped_replica(process)
            process.kill()
            process.wait(timeout=60)
            os.kill(replica, signal.SIGCONT)
            deadline = time.monotonic() + 60
            while replica in _session(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            log.seek(0)
            text = log.read()
            assert replica not in _session(process.pid), text
            assert f"dlo serve: replica {replica}: its server (pid {process.pid}) is gone; exiting" in text, text
            assert "BrokenPipeError" not in text, text
        finally:
            for pid in _session(process.pid):  # the ones this test's server started
                os.kill(pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()


WATCHED_REPLICA = """
import os, sys, threading, time
from dlo.serve.replica import _exit_with_server
read, write = os.pipe()
if sys.argv[1] == "closed":
    os.close(read)  # the server's end of its log pipe, gone with it
else:
    os.set_blocking(write, False)
    try:
        while True:
            os.write(write, bytes(4096))  # a reader that never reads: the pipe is full
    except BlockingIOError:
        os.set_blocking(write, True)
os.dup2(write, 2)
# Any pid but the parent's: to the watcher, its server is gone.
threading.Thread(target=_exit_with_server, args=(os.getppid() + 1,), daemon=True).start()
time.sleep(60)
os._exit(0)
"""


@pytest.mark.parametrize("stderr", ["closed", "full"])
def test_a_replica_whose_server_is_gone_exits_whatever_its_stderr(stderr):
    result = subprocess.run([sys.executable, "-c", WATCHED_REPLICA, stderr], timeout=120)
    assert result.returncode == 1


def test_a_port_another_server_listens_on_by_the_end_of_the_load_is_one_line(tiny_flux_dir, tmp_path):
    """Servers set SO_REUSEADDR, and two such sockets may bind one port while neither listens:
    one that starts listening there while the replicas load wins it; dlo serve then says so in
    one line naming the flags (status 2) and leaves no replica behind."""
    port = free_port()
    with open(tmp_path / "serve.log", "w+") as log, socket.socket() as other:
        process = _serve(tiny_flux_dir, tmp_path, log, port)
        try:
            replica = _stopped_replica(process)
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
            other.listen()
            os.kill(replica, signal.SIGCONT)
            status = process.wait(timeout=120)
            deadline = time.monotonic() + 30
            while _session(process.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            log.seek(0)
            errors = [line for line in log.read().splitlines() if line.startswith("dlo: error:")]
            assert status == 2 and errors == [
                f"dlo: error: --host 127.0.0.1 --port {port}: cannot serve there (Address already in use); give a "
                "free --port, or a --host address of this machine"
            ], errors
            assert not _session(process.pid)
        finally:
            for pid in _session(process.pid):
                os.kill(pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()


# One process tries `dlo serve` once per library of the [serve] extra, with that library (and
# only it) failing to import, as an install without it does: a meta-path finder refuses it, and
# whatever of it an earlier round imported is dropped from sys.modules first. One process for
# the three: each round's refusal comes before the model is looked up, so nothing a round
# loads changes the next one's answer (three processes cost ~10 s each here: `dlo serve`
# imports torch first).
EXTRA_BLOCKED = """
import contextlib, io, json, sys
from dlo.cli.main import main

class Blocker:
    def __init__(self, blocked):
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

report = []
for blocked in sys.argv[2:]:
    for name in [m for m in sys.modules if m.split(".")[0] == blocked]:
        del sys.modules[name]
    blocker = Blocker(blocked)
    sys.meta_path.insert(0, blocker)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["serve", sys.argv[1], "--device", "cpu"])
    sys.meta_path.remove(blocker)
    report.append([blocked, status, out.getvalue(), err.getvalue()])
print(json.dumps(report))
"""
EXTRA = ("fastapi", "uvicorn", "prometheus_client")


def test_serve_without_its_extra_names_the_extra_to_install_before_the_model_is_looked_up(tmp_path):
    """For each of fastapi, uvicorn and prometheus_client (formerly one process each, now
    rounds of one process): status 2, nothing on stdout, and the one stderr line naming the
    library that does not import and the extra to install, though the model does not exist."""
    done = subprocess.run(
        [sys.executable, "-c", EXTRA_BLOCKED, str(tmp_path / "no-such-pipeline"), *EXTRA],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert [blocked for blocked, _, _, _ in report] == list(EXTRA)
    for blocked, status, out, err in report:
        assert (status, out) == (2, ""), (blocked, status, out, err)
        assert err.splitlines() == [
            f"dlo: error: dlo serve needs the [serve] extra ({blocked} does not import): pip install 'dlo[serve]'"
        ], blocked


def test_components_are_checked_before_the_replicas_start_and_each_replica_streams_them(
    tiny_flux_dir, replicas_never_start, capsys
):
    import numpy as np
    import torch

    import dlo
    from dlo.models.tiny_pipelines import GENERATE_DEFAULTS
    from dlo.serve.replica import ReplicaSpec, _load
    from plain_pipeline import plain_pipeline

    argv = ["serve", str(tiny_flux_dir), "--device", "cpu", "--port", str(free_port()), "--no-host-weight-cache"]
    assert main([*argv, "--components", "tokenizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--components: components names 'tokenizer'" in err, err
    spec = ReplicaSpec(str(tiny_flux_dir), "cpu", torch.float32, dlo.OffloadConfig(), components=("text_encoder_2",))
    pipe, handle = _load(spec)
    kwargs = dict(GENERATE_DEFAULTS["flux"], num_inference_steps=2)
    try:
        assert handle.placement["text_encoder_2"] == "streamed" and handle.stats()["text_encoder_2"].copies == 0
        with torch.inference_mode():
            got = pipe("a red cube", generator=torch.Generator().manual_seed(0), **kwargs).images[0]
        assert handle.stats()["text_encoder_2"].copies > 0
    finally:
        handle.disable()
    with torch.inference_mode():
        want = plain_pipeline(tiny_flux_dir)("a red cube", generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert np.array_equal(np.asarray(got), np.asarray(want))
