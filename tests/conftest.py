import copy
import gc
import os
import threading
from pathlib import Path

import pytest
import torch
import tqdm

from dlo.models.tiny import TINY_MODELS

# Under xdist the workers share the cores: each gets its share for torch's intra-op threads (1
# with `-n 2` on 2 cores), and so do the processes the tests start (OMP_NUM_THREADS is
# inherited: a child and the test that checks its outputs bit for bit use the same threads).
# More OpenMP threads than cores spin in barriers: tests/test_parity.py under `-n 2` on 2 shared
# cores took 137 CPU seconds with 2 threads a worker, 40 with 1 (tests/test_compile.py found
# the same for inductor's kernels).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# A KeyboardInterrupt raised by an alarm at a random instant inside tqdm can leave tqdm's class
# lock held by the main thread: its default lock is two locks taken one after the other in a
# Python loop, and a bar's refresh() releases the lock without a `finally`. The main thread
# still takes it (it is recursive); any other thread's progress bar then waits forever (a cache
# writer thread in tests/test_cache_cli.py hung until pytest's timeout, with tqdm's monitor
# thread stuck beside it). Here the lock is one thread lock, taken in one C call; the tests that
# raise such alarms during a pipeline call (diffusers' progress bar) also disable its bar, so no
# refresh() runs.
tqdm.tqdm.set_lock(threading.RLock())

# Modules whose tests run on one xdist worker, as one unit: their module fixture (a `dlo serve`
# server, a 211 MB checkpoint) is set up once, not once per worker.
ONE_WORKER_MODULES = {"tests/test_serve.py", "tests/test_serve_video.py", "tests/test_page_sharing.py"}
# Tests of a real-width Flux (diffusers' Flux converter splits at width 3072: a 1 GB block pair),
# run one after the other on one worker: each makes GBs of fresh memory, which is slow to fault
# in on the test machines (8 s a GB here), and two at once on both workers took 2-3x as long.
REAL_WIDTH_TESTS = {
    "tests/test_single_file_mapping.py::test_a_flux_file_in_bfl_layout_streams_its_fused_projections_split_in_place",
    "tests/test_single_file_mapping.py::test_a_comfyui_scaled_fp8_flux_file_in_bfl_layout_gives_each_split_part_its_fused_scale",
    "tests/test_gguf_mapping.py::test_a_flux_gguf_file_in_bfl_layout_maps_each_split_projection_in_place",
}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (dist "load"): tests go to the workers one by one, each module of
    ONE_WORKER_MODULES as one unit and REAL_WIDTH_TESTS as another (handed out first: xdist
    starts with the largest units).
    xdist's own `--dist loadgroup` does not group here: xdist 3.8 writes the group into
    `item._nodeid`, which pytest 9.2 no longer reads."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if nodeid in REAL_WIDTH_TESTS:
                return "real-width Flux"
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


# Modules with tests of seconds to tens of seconds each (processes they start, servers, inductor
# compiles), most costly first: they are collected, so handed out, before every other module
# (after ONE_WORKER_MODULES), and the run ends on tests of a fraction of a second instead of
# one worker finishing a 15 s test while the other waits. Each module's tests keep their order.
SLOW_MODULES_FIRST = [
    "tests/test_compile.py", "tests/test_cli_process.py", "tests/test_gguf_kernels.py", "tests/test_serve_stall.py",
    "tests/test_lora.py", "tests/test_fp8_compute.py", "tests/test_serve_startup.py", "tests/test_cli_refusals.py",
    "tests/test_allgather.py", "tests/test_cli.py", "tests/test_pipeline_budget.py",
]


def pytest_collection_modifyitems(config, items):
    first = {module: rank for rank, module in enumerate(SLOW_MODULES_FIRST)}

    def rank(item) -> int:  # REAL_WIDTH_TESTS (42 s in a row, one worker) before all
        return -1 if item.nodeid in REAL_WIDTH_TESTS else first.get(item.nodeid.split("::", 1)[0], len(first))

    items.sort(key=rank)  # stable


# [Note: frozen heap] A full collection (gc.collect(), and those Python runs by itself) walks
# every object the collector tracks: in a worker that has imported torch, diffusers and
# transformers and collected the suite, ~360k objects, 0.15-0.25 s a walk. The host weight cache
# collects on every load (dlo.host.cache.consume._release_private_memory), tests collect to
# prove what is freed: ~1/4 of a worker's CPU in the cache and hot-path modules went to walking
# objects that live as long as the worker. So at the start of each module's tests the objects
# alive then (libraries, collected tests, session fixtures) are moved to the permanent
# generation, which collections skip: after a full collection (garbage is collected, not
# frozen), and only between modules, where no module or function fixture is alive. Everything a
# module's tests and fixtures create is collected exactly as before.
_frozen_for = [None]  # the module whose tests run since the last freeze


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    module = getattr(item, "module", None)
    if module is not _frozen_for[0]:
        _frozen_for[0] = module
        gc.collect()
        gc.freeze()


@pytest.fixture
def tiny_pair():
    """(resident reference, deep copy to stream, tiny model entry) for a tiny model name."""

    def make(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
        entry = TINY_MODELS[name]
        reference = entry.build(seed=seed, dtype=dtype)
        return reference, copy.deepcopy(reference), entry

    return make


@pytest.fixture
def small_filesystem(tmp_path):
    """Mounts a real tmpfs with the given options for the test (needs root)."""
    import subprocess

    mounted = []

    def mount(options):
        mount_point = tmp_path / f"fs{len(mounted)}"
        mount_point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode().strip()}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny FluxPipeline directory, written once per test session (read-only for tests)."""
    from dlo.models.tiny_pipelines import save_tiny_flux_pipeline

    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("pipelines") / "flux")


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """A tiny WanPipeline directory, written once per test session (read-only for tests)."""
    from dlo.models.tiny_pipelines import save_tiny_wan_pipeline

    return save_tiny_wan_pipeline(tmp_path_factory.mktemp("pipelines") / "wan")


@pytest.fixture
def driver(monkeypatch):
    """A fake registration driver standing in for the CUDA driver on the CPU device (records
    every call, fails where told to)."""
    from fake_driver import FakeDriver

    from dlo.backend import cuda_registration

    fake = FakeDriver()
    monkeypatch.setattr(cuda_registration, "registration_driver", lambda device: fake)
    return fake


@pytest.fixture(scope="session")
def tiny_loras(tmp_path_factory):
    """kind -> {adapter name: LoRA file} for the tiny model `kind` (seed 0) of
    dlo.models.tiny, written once per session by diffusers' save_lora_weights (lora_files.py)."""
    from lora_files import save_loras

    made: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in made:
            made[kind] = save_loras(TINY_MODELS[kind].build(), kind, tmp_path_factory.mktemp(f"lora-{kind}"))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_flux_loras(tiny_flux_dir, tiny_wan_dir, tmp_path_factory):
    """LoRA files for the tiny Flux pipeline's transformer, written once per session: adapters
    "a" and "b" (lora_files.py); "wan", one of the tiny Wan pipeline's (another model); "wider",
    one of a wider Flux (another size of the model)."""
    import diffusers
    from lora_files import save_lora

    directory = tmp_path_factory.mktemp("pipeline-loras")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    made = {name: save_lora(transformer, "flux", name, directory, seed) for seed, name in enumerate("ab", 1)}
    wan = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer")
    made["wan"] = save_lora(wan, "wan", "a", directory / "wan", 3)
    wider = dict(transformer.config)
    wider["num_attention_heads"] += 1  # every attention Linear is wider
    made["wider"] = save_lora(diffusers.FluxTransformer2DModel.from_config(wider), "flux", "b", directory / "wider", 4)
    return made


@pytest.fixture(autouse=True)
def allocator_settings_kept():
    """`dlo` commands run in-process with --hbm-budget-gib set PYTORCH_CUDA_ALLOC_CONF (See
    [Note: allocator under a budget]): put it back, so later tests and their subprocesses run
    with the allocator settings the session started with."""
    before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    yield
    if before is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before


@pytest.fixture
def large_file_dir(tmp_path):
    """A directory for files of a GB or so: on /dev/shm where it is a tmpfs with room, else
    tmp_path. Writing 1 GB through a virtual machine's disk filesystem cost 8-16 s of kernel
    time here (a tmpfs: 0.4 s); a tmpfs file is mapped and read as any other."""
    import shutil
    import tempfile

    room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    if room < 8 << 30:
        yield tmp_path
        return
    directory = tempfile.mkdtemp(prefix="dlo-test-", dir="/dev/shm")
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
