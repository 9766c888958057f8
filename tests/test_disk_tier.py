"""The disk tier: blocks beyond host_budget_gib are read from their files on every use with
direct I/O, on a real file system (docs/guides/disk-tier.md, [Note: the disk tier])."""

import ctypes
import logging
import mmap
import os
import random
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from ordinary_tensors import ordinary_tensors
from safetensors.torch import save_file

import dlo
from dlo.host.block_sources import DiskSource, MappedSource
from dlo.host.checkpoint import Checkpoint
from dlo.host.direct_reads import BlockReads, DiskReader, ReadImage
from dlo.host.memory_budget import RESERVE_MIN, available_host_bytes
from dlo.host.tensor_source import TensorSource
from dlo.hotpath.executors import CpuExecutor
from dlo.hotpath.read_ahead import ReadAhead
from dlo.models.tiny import TINY_MODELS
from dlo.planning.host_tier import GIB, plan_host_tier

diffusers = pytest.importorskip("diffusers")

LIBC = ctypes.CDLL(None, use_errno=True)
CPU_EVENTS = CpuExecutor(torch.device("cpu")).staging_event  # copies out of a buffer are done when they return


def save(directory, name, seed=2):
    TINY_MODELS[name].build(seed=seed).save_pretrained(directory)
    files = sorted(directory.glob("*.safetensors"))
    drop_pages(files)
    return files


def drop_pages(files):
    """The files' pages out of the page cache (written back first), as after a reboot."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore of a fresh mapping)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    residency = (ctypes.c_ubyte * pages)()
    view = np.frombuffer(mapping, dtype=np.uint8)
    try:
        assert LIBC.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), residency) == 0, ctypes.get_errno()
    finally:
        del view
        mapping.close()
    return sum(page & 1 for page in residency)


def storage_read_bytes() -> int:
    """This process's bytes read from storage (/proc/self/io), page cache hits not counted."""
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def outputs(model, name, seeds=(1, 2, 3), dtype=torch.float32):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype))[0] for seed in seeds]


def ordinary(directory, name):
    model = getattr(diffusers, TINY_MODELS[name].class_name).from_pretrained(directory).eval()
    ordinary_tensors(model)
    return model


def call_cut_by_a_timer(model, inputs, after_s):
    """Call `model` with a timer that raises KeyboardInterrupt after `after_s` (as Ctrl-C
    would), wherever the call then is; a call that ends first is simply done."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with torch.inference_mode():
            signal.setitimer(signal.ITIMER_REAL, after_s)
            try:
                model(**inputs)
                signal.setitimer(signal.ITIMER_REAL, 0)  # in the try: the timer may fire just before
            except KeyboardInterrupt:
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def budget_gib(files, fraction):
    return sum(f.stat().st_size for f in files) * fraction / GIB


@pytest.fixture
def fresh_dynamo():
    """A test that compiles does so from scratch, on one thread: inductor's CPU kernels spin in
    OpenMP barriers on a shared machine."""
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
@pytest.mark.parametrize("fraction", [0.3, 0.9])
def test_blocks_beyond_the_budget_stream_from_disk_bit_identical(tmp_path, name, fraction):
    files = save(tmp_path / name, name)
    model, plan = dlo.load_transformer(tmp_path / name)
    config = dlo.OffloadConfig(host_budget_gib=budget_gib(files, fraction))
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        spread = handle.stats().disk.blocks
        got = outputs(model, name)  # a warm-up call, the measured one, then the blocks chosen from it
        stats = handle.stats()
    expected = outputs(ordinary(tmp_path / name, name), name)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    disk = stats.disk
    assert disk is not None and 0 < len(disk.blocks) <= stats.streamed_blocks
    assert disk.choice.state == "chosen"
    # Every use of a disk block read it once: two calls over the blocks of enable(), one over
    # those chosen; beyond them, reads ahead for the next call (at most the two buffers and
    # the prefetch of its first block), also before the choice (then dropped).
    uses = 2 * len(spread) + len(disk.blocks)
    assert uses <= disk.reads <= uses + 6
    assert disk.direct_io and disk.read_bytes > 0
    assert stats.registration_fallback.startswith("host_budget_gib")
    if fraction == 0.9:  # some blocks stay, as private copies read once at enable()
        assert len(disk.blocks) < stats.streamed_blocks and stats.host_bytes > 0


def test_regional_compile_over_the_disk_tier_equals_the_model_compiled_resident(tmp_path, fresh_dynamo):
    """torch.compile composes with the disk tier: the blocks compiled regionally (the user's
    compile_repeated_blocks, after enable) stream from disk and compute what the same model
    compiled and resident computes. See [Note: compiled blocks]"""
    files = save(tmp_path / "wan", "wan")
    reference = ordinary(tmp_path / "wan", "wan")
    reference.compile_repeated_blocks(fullgraph=True)
    expected = outputs(reference, "wan")
    model, plan = dlo.load_transformer(tmp_path / "wan")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.3)), plan=plan) as handle:
        model.compile_repeated_blocks(fullgraph=True)
        got = outputs(model, "wan")
        stats = handle.stats()
    assert stats.disk.reads >= 3 * len(stats.disk.blocks) > 0 and stats.compile.graphs >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_whole_model_compile_over_the_disk_tier_equals_the_resident_model_compiled_with_its_boundaries(tmp_path, fresh_dynamo):
    """torch.compile of the whole model composes with the disk tier: the graph breaks at the
    streamed blocks, whose weights stream from disk, and the outputs equal the resident model
    compiled with breaks at the same places. See [Note: compiled blocks]"""
    from dlo.hotpath.compiled_call import isolate

    files = save(tmp_path / "wan", "wan")
    reference = ordinary(tmp_path / "wan", "wan")
    boundaries = isolate(list(reference.blocks))
    expected = outputs(torch.compile(reference), "wan")
    for boundary in boundaries:
        boundary.remove()
    torch._dynamo.reset()
    model, plan = dlo.load_transformer(tmp_path / "wan")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.3)), plan=plan) as handle:
        got = outputs(torch.compile(model), "wan")
        stats = handle.stats()
    assert stats.disk.reads >= 3 * len(stats.disk.blocks) > 0
    assert stats.compile.graphs >= 1 and stats.compile.graph_breaks >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_disk_tier_leaves_the_page_cache_empty_and_reads_each_use_once(tmp_path):
    """Caches dropped first: each call reads its disk blocks once from storage (the kernel's
    /proc/self/io agrees with dlo's count), and afterwards not one page of the checkpoint is
    cached (mincore)."""
    files = save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.5)), plan=plan) as handle:
        reads = handle._runtime.read_ahead

        def calls(seeds):
            got = outputs(model, "flux", seeds)
            handle.stats()  # every queued load has taken its read (the next call's first block too)
            reads.wait_idle()  # and the read-ahead has filled its buffers for the next call
            return got, storage_read_bytes(), handle.stats().disk

        calls((1, 2))  # the warm-up and the measured call: the blocks on disk are chosen after it
        _, storage0, disk0 = calls((1,))
        _, storage1, disk1 = calls((2,))
        got, storage2, disk2 = calls((3, 4, 5))
        cached = [cached_pages(path) for path in files]
    assert disk0.choice.state == "chosen" and disk2.blocks == disk0.blocks
    blocks = len(disk0.blocks)
    assert disk1.reads - disk0.reads == blocks and disk2.reads - disk1.reads == 3 * blocks
    per_call = disk1.read_bytes - disk0.read_bytes
    assert per_call > 0 and disk2.read_bytes - disk1.read_bytes == 3 * per_call
    assert 3 * per_call <= storage2 - storage1 <= 3 * per_call + 2**20  # the kernel read them from storage
    assert storage1 - storage0 >= per_call
    assert cached == [0] * len(files)
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux", seeds=(3, 4, 5))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_budget_change_between_enables_moves_blocks_between_ram_and_disk(tmp_path):
    files = save(tmp_path / "wan", "wan")
    expected = outputs(ordinary(tmp_path / "wan", "wan"), "wan")
    on_disk = []
    for fraction in (0.9, 0.3, 10.0):
        model, plan = dlo.load_transformer(tmp_path / "wan")
        with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, fraction)), plan=plan) as handle:
            assert all(torch.equal(a, b) for a, b in zip(outputs(model, "wan"), expected)), fraction
            disk = handle.stats().disk
            on_disk.append(disk.blocks if disk is not None else ())
    assert 0 < len(on_disk[0]) < len(on_disk[1]) and on_disk[2] == ()  # a budget that holds the model: RAM only


def test_a_budget_that_holds_the_model_changes_nothing(tmp_path):
    """RAM is preferred: the blocks stream from the mapping as without a budget."""
    files = save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 2.0)), plan=plan) as handle:
        outputs(model, "flux", seeds=(1,))
        stats = handle.stats()
    assert stats.disk is None and stats.staging_bytes > 0 and stats.registration_fallback == ""


def test_a_budget_below_one_read_is_refused_before_the_plan_is_taken(tmp_path):
    files = save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with pytest.raises(dlo.ConfigError, match=r"host_budget_gib=[0-9.e-]+ GiB cannot hold .* raise it to at least"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=1e-6), plan=plan)
    assert not plan.taken  # nothing was lost: the same plan enables with a budget that works
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.5)), plan=plan):
        got = outputs(model, "flux")
    assert all(torch.equal(a, b) for a, b in zip(got, outputs(ordinary(tmp_path / "flux", "flux"), "flux")))


def test_a_model_of_private_copies_beyond_the_budget_is_refused_with_the_fix(tiny_pair):
    reference, model, _ = tiny_pair("flux", seed=1)
    weights = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(dlo.ConfigError, match="no streamed block is in a file: load the model with dlo.load_transformer"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=1e-4))
    assert [p.data_ptr() for p in model.parameters()] == weights  # untouched
    assert torch.equal(outputs(model, "flux", (1,))[0], outputs(reference, "flux", (1,))[0])


def test_a_file_system_that_refuses_o_direct_is_read_buffered_with_its_pages_dropped(tmp_path, caplog):
    """ramfs refuses O_DIRECT (EINVAL at open): the reads fall back to buffered ones, logged
    with the code, and stay bit-identical."""
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount ramfs here (needs root): {done.stderr.decode().strip()}")
    try:
        files = save(mount_point / "wan", "wan")
        model, plan = dlo.load_transformer(mount_point / "wan")
        with caplog.at_level(logging.WARNING, logger="dlo.host.direct_reads"):
            with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.5)), plan=plan) as handle:
                got = outputs(model, "wan")
                disk = handle.stats().disk
        assert not disk.direct_io and disk.reads >= 3 * len(disk.blocks) > 0
        assert "direct_io_refused" in caplog.text and "refused O_DIRECT" in caplog.text
        assert all(torch.equal(a, b) for a, b in zip(got, outputs(ordinary(mount_point / "wan", "wan"), "wan")))
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_a_file_cut_short_after_enable_fails_the_call_and_the_next_call_is_exact(tmp_path):
    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.3)), plan=plan):
        assert torch.equal(outputs(model, "flux", (1,))[0], expected[0])
        (path,) = files
        content = path.read_bytes()
        with open(path, "r+b") as handle:
            handle.truncate(len(content) // 8)  # past the header: every block after it is cut
        drop_pages(files)
        with pytest.raises(dlo.StreamingError, match="ended early"):
            outputs(model, "flux", (1,))
        with open(path, "r+b") as handle:  # the same file (inode) whole again
            handle.write(content)
        assert all(torch.equal(a, b) for a, b in zip(outputs(model, "flux"), expected))


def test_all_gather_in_a_group_of_one_reads_its_shards_from_disk_bit_identical(tmp_path):
    """A group of one (no process group): every block's shard is the whole block, read per use
    (See [Note: shards read from disk]); the page cache stays empty, the calls and the
    module after disable() equal resident."""
    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib(files, 0.9))
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        got = outputs(model, "flux")
        stats = handle.stats()
        kinds = {type(b.source).__name__ for b in handle._runtime.blocks}
        cached = sum(cached_pages(path) for path in files)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert kinds == {"DiskShardSource", "ShardSource"} and stats.gather_group_size == 1
    assert stats.disk.reads >= 3 * len(stats.disk.blocks) > 0 and stats.disk.choice.state == "kept"
    assert stats.host_bytes + stats.disk.read_buffer_bytes <= stats.disk.budget_bytes
    assert cached <= 2  # the header page, and the last one of a span that ends past the file
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, "flux"), expected))


@pytest.mark.parametrize("seed", range(6))
def test_ctrl_c_at_any_instant_of_a_call_over_shards_on_disk_leaves_later_calls_exact(tmp_path, seed):
    """A timer raises KeyboardInterrupt at a random instant of a call (reads, copies out of the
    read buffers, the steps around them): the next calls equal resident and disable() gives
    the module back whole."""
    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib(files, 0.9))
    inputs = TINY_MODELS["flux"].inputs(1, torch.float32)
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        with torch.inference_mode():
            started = time.perf_counter()
            model(**inputs)
            call_s = time.perf_counter() - started
        call_cut_by_a_timer(model, inputs, random.Random(seed).uniform(0.0, 1.5) * call_s)
        got = outputs(model, "flux")
        disk = handle.stats().disk
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert disk is not None and len(disk.blocks) > 0
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, "flux"), expected))


def test_disable_right_after_ctrl_c_in_a_block_closes_the_call_before_the_reads_stop(tmp_path):
    """Ctrl-C while a block computes skips the call's end; disable() then issues the rest of
    the call's loads (shards on disk among them) before it releases the read-ahead, and gives
    the module back whole."""
    files = save(tmp_path / "flux", "flux")
    reference = ordinary(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib(files, 0.9))
    handle = dlo.enable(model, "cpu", config, plan=plan)
    outputs(model, "flux", (1,))

    def interrupt(module, args):
        raise KeyboardInterrupt

    hook = model.transformer_blocks[0].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        outputs(model, "flux", (1,))
    hook.remove()
    handle.disable()
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)


def _shards_on_disk_then_cut_short(tmp_path):
    """All-gather in a group of one with 4 of 5 tiny Flux blocks read from disk, one call
    made, then the checkpoint file cut to an eighth: (handle, model, files)."""
    files = save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib(files, 0.9))
    handle = dlo.enable(model, "cpu", config, plan=plan)
    outputs(model, "flux", (1,))
    (path,) = files
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 8)
    return handle, model, files


def test_disable_after_a_file_was_cut_short_raises_instead_of_reading_its_mapping(tmp_path):
    """disable() gathers the shards on disk again: read by path, a file cut short since
    enable() fails with an error naming it (through the mapping, the read would end the process
    with SIGBUS)."""
    handle, _, _ = _shards_on_disk_then_cut_short(tmp_path)
    cut_short = r"diffusion_pytorch_model.safetensors is not the file dlo mapped .*resized"
    with pytest.raises(dlo.StreamingError, match=cut_short):
        handle.disable()


def test_an_automatic_host_budget_is_refused_in_all_gather_mode():
    with pytest.raises(dlo.ConfigError, match="host_budget_gib='auto' measures each rank's free memory"):
        dlo.OffloadConfig(host_budget_gib="auto", use_allgather=True)


def test_a_shard_read_that_fails_breaks_off_the_rank_with_the_file_named(tmp_path):
    """A read of a shard fails before its collective: the rank's collectives would no longer
    pair with its peers', so this and every later call raise, naming the file, then the fix."""
    handle, model, files = _shards_on_disk_then_cut_short(tmp_path)
    drop_pages(files)
    with pytest.raises(dlo.StreamingError, match="ended early"):
        outputs(model, "flux", (1,))
    with pytest.raises(dlo.StreamingError, match="was not read and gathered .*restart the job"):
        outputs(model, "flux", (1,))
    with pytest.raises(dlo.StreamingError):
        handle.disable()


def test_all_gather_refuses_a_budget_when_no_shard_can_be_read_as_saved(tmp_path):
    """Cast blocks (a float32 checkpoint loaded as bfloat16) cannot be read a shard at a time:
    refused in one line that says why, before the plan is taken."""
    save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux", torch_dtype=torch.bfloat16)
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=1e-5)
    with pytest.raises(dlo.ConfigError, match="no streamed block's shard can be read from disk.*use_allgather=False"):
        dlo.enable(model, "cpu", config, plan=plan)
    assert not plan.taken


def test_a_file_replaced_after_it_was_mapped_is_refused_by_name(tmp_path):
    """load_transformer mapped one file; another now has its name (a fresh download, say):
    the disk tier reads by name, so it refuses to read it, before any weight is used."""
    files = save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    (path,) = files
    replacement = path.with_suffix(".new")
    replacement.write_bytes(path.read_bytes())
    os.replace(replacement, path)  # another inode under the same name
    weights = {name: p for name, p in model.named_parameters()}
    with pytest.raises(dlo.StreamingError, match="is not the file dlo mapped at enable"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, 0.9)), plan=plan)
    assert {name: p for name, p in model.named_parameters()}.keys() == weights.keys()


def _block_files(tmp_path, count, nbytes):
    """A checkpoint of `count` tensors, tensor i all bytes i (one per block), and its disk sources."""
    tensors = {f"b{i}": torch.full((nbytes,), i, dtype=torch.uint8) for i in range(count)}
    save_file(tensors, tmp_path / "diffusion_pytorch_model.safetensors")
    checkpoint = Checkpoint(tmp_path)
    sources = {}
    for i in range(count):
        mapped = MappedSource(checkpoint, (TensorSource((f"b{i}",), (nbytes,), torch.uint8),))
        sources[i] = DiskSource(mapped, BlockReads.plan(checkpoint, [f"b{i}"]))
    return checkpoint, sources


@pytest.mark.parametrize("seed", range(4))
def test_read_ahead_under_random_orders_and_forgets_hands_out_only_the_block_asked_for(tmp_path, seed):
    """Random take orders (mostly the predicted one), random holding times, blocks forgotten
    midway, against real files: every buffer taken holds the block asked for, and still does
    when given back (no read overwrote it while taken)."""
    rng = random.Random(seed)
    checkpoint, sources = _block_files(tmp_path, 6, 3 * 4096 + 100)
    reads = ReadAhead(sources, DiskReader(3), rng.choice([1, 2]), max(s.reads.nbytes for s in sources.values()), False, CPU_EVENTS)
    live = list(range(6))
    try:
        position = 0
        for step in range(120):
            if rng.random() < 0.7:
                index = live[position % len(live)]
                position += 1
            else:
                index = rng.choice(live)
            buffer = reads.take(index)
            value = ReadImage(checkpoint, sources[index].reads, buffer.tensor).view(f"b{index}")
            assert bool((value == index).all()), (step, index)
            time.sleep(rng.uniform(0, 0.002))
            assert bool((value == index).all()), (step, index)
            reads.give_back(buffer)
            if len(live) > 2 and rng.random() < 0.05:
                gone = rng.choice(live)
                live.remove(gone)
                reads.forget(gone)
        reads.wait_idle()
        assert reads.reads <= 120 + 120 + 2  # predicted reads wasted at most once per take, plus the buffers
    finally:
        reads.close()
        checkpoint.close()


def test_a_load_waiting_for_a_read_fails_when_the_reads_stop(tmp_path):
    checkpoint, sources = _block_files(tmp_path, 2, 4096)
    reads = ReadAhead(sources, DiskReader(1), 1, 8192, False, CPU_EVENTS)
    reads.stop()
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(dlo.StreamingError, reads.take, 1)))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and errors
    reads.close()
    checkpoint.close()


def test_which_blocks_stay_is_an_even_spread_of_the_rest_after_the_read_buffers():
    names = [f"b{i}" for i in range(12)]
    sizes = [100] * 12
    # The model fits: nothing on disk.
    assert plan_host_tier(names, sizes, sizes, 1200).on_disk == ()
    # 2 read buffers of 100, then 6 blocks kept: 6 on disk, every other block.
    tier = plan_host_tier(names, sizes, sizes, 800)
    assert tier.read_buffers == 2 and tier.on_disk == (1, 3, 5, 7, 9, 11)
    # Room for one buffer only: one is used, and nothing else stays.
    tier = plan_host_tier(names, sizes, sizes, 150)
    assert tier.read_buffers == 1 and len(tier.on_disk) == 12
    # A private block (no file) must stay and counts first.
    read = [None] + sizes[1:]
    tier = plan_host_tier(names, sizes, read, 500)
    assert 0 not in tier.on_disk and tier.read_buffers == 2 and len(tier.on_disk) == 9
    with pytest.raises(dlo.ConfigError, match=r"[0-9.e-]+ GiB of blocks that are private copies .*one read of the largest block, 'b1'"):
        plan_host_tier(names, sizes, read, 150)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "2", "most"])
def test_a_host_budget_that_is_not_a_size_is_refused(value):
    with pytest.raises(dlo.ConfigError, match="host_budget_gib must be a finite number of GiB > 0, 'auto' or None"):
        dlo.OffloadConfig(host_budget_gib=value)


def test_auto_is_what_the_machine_and_the_cgroup_leave_less_a_reserve(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 100 kB\nMemAvailable: {64 * 2**20} kB\n")  # 64 GiB
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_host_bytes(meminfo, cgroup) == 64 * GIB - int(6.4 * GIB)  # no cgroup limit: 10 % reserved
    (cgroup / "memory.max").write_text(f"{20 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{4 * GIB}\n")
    assert available_host_bytes(meminfo, cgroup) == 14 * GIB  # the cgroup leaves less; 10 % of it is below 2 GiB
    (cgroup / "memory.current").write_text(f"{19 * GIB}\n")
    assert available_host_bytes(meminfo, cgroup) == 0  # less than the reserve
    assert RESERVE_MIN == 2 * GIB
    assert available_host_bytes(tmp_path / "none", tmp_path / "none") == 0


def test_auto_on_this_machine_streams_everything_from_ram_when_it_fits(tmp_path):
    save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib="auto"), plan=plan) as handle:
        outputs(model, "flux", (1,))
        assert handle.stats().disk is None


@pytest.mark.parametrize("fraction", [None, 0.3], ids=["mapped", "disk-tier"])
def test_an_edit_of_a_file_block_is_copied_on_write_and_nothing_else_is(tmp_path, fraction):
    """The files are never written: the one block whose weights change becomes a private copy
    (under a budget: in host memory beyond it, out of the disk tier), the unchanged ones are
    not copied (their padding, which nothing reads, may differ), and the next calls equal the
    same edit resident."""
    files = save(tmp_path / "flux", "flux")
    reference = ordinary(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    contents = [path.read_bytes() for path in files]
    config = dlo.OffloadConfig(host_budget_gib=fraction and budget_gib(files, fraction))
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        outputs(model, "flux", (1,))
        disk = handle.stats().disk
        edited = disk.blocks[0] if disk is not None else "transformer_blocks.1"
        weight = f"{edited}.{next(n for n, p in reference.get_submodule(edited).named_parameters() if p.dim() == 2)}"
        with handle.editing(), torch.no_grad():
            model.get_parameter(weight).mul_(0.5)
        with torch.no_grad():
            reference.get_parameter(weight).mul_(0.5)
        got = outputs(model, "flux")
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, outputs(reference, "flux")))
    assert stats.rewritten_blocks == 1 and stats.copied_on_write_bytes > 0
    if disk is not None:
        assert edited not in stats.disk.blocks and len(stats.disk.blocks) == len(disk.blocks) - 1
    assert [path.read_bytes() for path in files] == contents


def test_a_float8_checkpoint_is_read_from_disk_as_stored(tmp_path):
    """float8 bytes and their scales are what is read: about half the bytes of bf16."""
    from fp8_checkpoints import resident_from, write_fp8_checkpoint

    directory, dequantized = write_fp8_checkpoint(tmp_path)
    expected = outputs(resident_from(dequantized), "flux", dtype=torch.bfloat16)
    model, plan = dlo.load_transformer(directory)
    # The tiny file is mostly its bf16 embeddings: 2/3 of its 0.00055 GiB of float8 blocks.
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=0.00037), plan=plan) as handle:
        got = outputs(model, "flux", dtype=torch.bfloat16)
        disk = handle.stats().disk
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert disk is not None and len(disk.blocks) > 0


def test_dlo_inspect_shows_which_blocks_a_budget_reads_from_disk(tmp_path, capsys):
    """The same split enable() makes, before anything is loaded; a budget too small is one line."""
    from dlo.cli.main import main

    files = save(tmp_path / "flux", "flux")
    budget = budget_gib(files, 0.5)
    assert main(["inspect", str(tmp_path / "flux"), "--host-budget-gib", str(budget)]) == 0
    out = capsys.readouterr().out
    shown = out.split("read from disk:", 1)[1].splitlines()[0].strip().split(", ")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget), plan=plan) as handle:
        assert list(handle.stats().disk.blocks) == shown
    assert main(["inspect", str(tmp_path / "flux"), "--host-budget-gib", "100"]) == 0
    assert "holds every streamed block: nothing is read from disk" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "flux"), "--host-budget-gib", "1e-9"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host-budget-gib" in err[0] and "raise it to at least" in err[0]
    assert main(["inspect", "FluxTransformer2DModel", "--host-budget-gib", "1"]) == 0
    assert "not applicable: FluxTransformer2DModel has no checkpoint" in capsys.readouterr().out
    for flags, says in [
        (["--nproc", "2"], "--nproc 2 shows the split of --host-budget-gib each all-gather rank makes; give"),
        (["--nproc", "2", "--host-budget-gib", "1", "--no-use-allgather"], "a rank-local rank makes the split one"),
        (["--nproc", "2", "--host-budget-gib", "auto"], "--host-budget-gib auto measures each rank's free memory"),
    ]:
        assert main(["inspect", str(tmp_path / "flux"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


def test_the_host_weight_cache_entry_is_read_from_disk_under_a_budget(tmp_path):
    """Blocks beyond the budget are read from the cache entry's files (published by the first
    load, mapped by the second), as they are from a checkpoint."""
    files = save(tmp_path / "wan", "wan")
    expected = outputs(ordinary(tmp_path / "wan", "wan"), "wan")
    for load in range(2):
        config = dlo.OffloadConfig(
            host_weight_cache=True, cache_dir=str(tmp_path / "cache"), host_budget_gib=budget_gib(files, 0.3)
        )
        model, plan = dlo.load_transformer(tmp_path / "wan", config)
        assert plan.backing == "host_weight_cache"
        with dlo.enable(model, "cpu", config, plan=plan) as handle:
            got = outputs(model, "wan")
            disk = handle.stats().disk
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), load
        assert disk is not None and disk.reads >= 3 * len(disk.blocks) > 0


def test_automatic_residency_over_disk_blocks_equals_resident(tmp_path):
    """resident_layers='auto' measures a call, then keeps blocks on the device: a disk block it
    promotes is packed from the mapping once, the others keep being read per use."""
    from dlo.planning.plan_summary import summarize

    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux", seeds=(1, 2, 3, 4))
    model, plan = dlo.load_transformer(tmp_path / "flux")
    summary = summarize(model, plan.offload_plan)
    config = dlo.OffloadConfig(
        resident_layers="auto", hbm_budget_gib=summary.total_bytes * 0.8 / GIB, host_budget_gib=budget_gib(files, 0.4)
    )
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        got = outputs(model, "flux", seeds=(1, 2, 3, 4))
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert stats.residency.state == "planned" and stats.residency.resident and stats.disk is not None, stats.residency
