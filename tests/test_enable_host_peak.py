"""enable()'s own host memory peak when it quantizes a bf16 model to fp8 (stream_dtype="fp8"):
from the checkpoint mapping, block by block, the peak stays about one block above what
enable() keeps; from a private bf16 model, the model's tensors are kept until enable() ends
(a failed enable() gives them back), so the peak holds both copies. disable() of a model under
the disk tier: the blocks read from disk are copied into private memory, unless
restore=False. Measured in fresh processes (tests/host_peak_child.py samples RssAnon)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
if not Path("/proc/self/status").exists():  # pragma: no cover - non-Linux
    pytest.skip("needs /proc/self/status", allow_module_level=True)

# 12 Wan blocks of 8.4 MB in bf16 (101 MB): large next to the interpreter's noise.
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=4, text_dim=32,
    freq_dim=32, ffn_dim=2048, num_layers=12, rope_max_seq_len=32,
)
MB = 1e6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WAN).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("wan_bf16")
    model.save_pretrained(directory)
    block = sum(t.numel() * t.element_size() for t in model.blocks[0].parameters())
    blocks = sum(t.numel() * t.element_size() for t in model.blocks.parameters())
    return directory, block, blocks


def measured(directory: Path, kind: str, *extra: str, env: dict | None = None) -> dict:
    child = Path(__file__).with_name("host_peak_child.py")
    done = subprocess.run(
        [sys.executable, str(child), str(directory), kind, *extra], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["finite"]
    return report


def test_fp8_from_the_checkpoint_mapping_peaks_about_one_block_above_what_it_keeps(checkpoint):
    directory, block, blocks = checkpoint
    report = measured(directory, "mapped")
    kept, peak = report["after"] - report["baseline"], report["peak"] - report["baseline"]
    print(f"\nmapped: peak {peak / MB:.1f} MB, kept {kept / MB:.1f} MB, one block {block / MB:.1f} MB")
    assert report["host_bytes"] < 0.6 * blocks  # the float8 images, about half the bf16 blocks
    # Measured 8.7 MB above what it keeps: one block's bf16 tensor and its float32 working copy.
    assert peak - kept < 2 * block


def test_fp8_from_a_private_bf16_model_holds_both_copies_until_enable_ends(checkpoint):
    """The issue 32 target (peak ≤ what enable() keeps + one block) is not met this way: the
    model's bf16 tensors stay until enable() ends, for its rollback."""
    directory, block, blocks = checkpoint
    report = measured(directory, "private")
    kept, peak = report["after"] - report["baseline"], report["peak"] - report["baseline"]
    print(f"\nprivate: peak {peak / MB:.1f} MB, kept {kept / MB:.1f} MB (the bf16 blocks freed: {blocks / MB:.1f} MB)")
    assert kept < peak - 0.8 * blocks  # freed at the end, not while quantizing


def test_blocks_moved_between_host_memory_and_disk_add_nothing_beyond_the_budget(checkpoint):
    """Under host_budget_gib, the choice made from the measured call swaps two disk blocks with
    two kept ones: the kept copies are released before the new ones are read, and the reads go
    through a read buffer, so the call's host peak stays where it was (a scratch buffer would
    add a block, 8.4 MB)."""
    directory, block, blocks = checkpoint
    # Every allocation of 128 KiB or more mapped on its own, so memory freed is returned at
    # once: RssAnon then follows what is live (glibc's adaptive threshold would keep freed
    # blocks in its heap for a while, and the peak would depend on its bookkeeping).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    report = measured(directory, "moves", str(0.5 * blocks / 2**30), env=env)
    print(f"\nmoves: before {report['before'] / MB:.1f} MB, peak {report['peak'] / MB:.1f} MB, after {report['after'] / MB:.1f} MB")
    assert report["moved"] == 4
    assert report["peak"] - report["before"] < 0.5 * block
    assert abs(report["after"] - report["before"]) < 0.5 * block


def test_disable_without_restore_copies_no_block_of_a_disk_tier_model(checkpoint):
    """Half the blocks kept in host memory, half on disk: disable() gives the disk blocks
    private copies (about half the model, which may be more than the host has), and
    disable(restore=False) copies nothing."""
    directory, block, blocks = checkpoint
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))  # See the test above
    budget = str(0.5 * blocks / 2**30)
    restored, dropped = (measured(directory, "disable", flag, budget, env=env) for flag in ("1", "0"))
    grew = {name: (r["peak"] - r["before"]) / MB for name, r in (("restored", restored), ("dropped", dropped))}
    print(f"\ndisable(): {grew['restored']:.1f} MB, restore=False: {grew['dropped']:.1f} MB (blocks {blocks / MB:.1f} MB)")
    assert grew["restored"] > 0.3 * blocks / MB  # the measurement sees the copies
    assert grew["dropped"] < block / MB
