import torch

from dlo.host.pinned_buffer import aligned_empty
from dlo.planning.block_layout import ALIGNMENT, TensorSpec, plan_block_layout, view_placement


def test_every_offset_and_the_total_are_512_aligned():
    specs = [
        TensorSpec("a", (3,), torch.float32),  # 12 bytes
        TensorSpec("b", (17, 257), torch.bfloat16),  # 8738 bytes
        TensorSpec("c", (), torch.float64),  # 8 bytes, 0-dim
        TensorSpec("d", (0, 5), torch.float32),  # empty
    ]
    layout = plan_block_layout(specs)
    # 12 -> 512; 512 + 8738 = 9250 -> 9728; 9728 + 8 -> 10240; empty tensor adds nothing
    assert [p.offset for p in layout.placements] == [0, 512, 9728, 10240]
    assert layout.nbytes == 10240
    assert layout.payload_bytes == 12 + 8738 + 8
    assert all(p.offset % ALIGNMENT == 0 for p in layout.placements)


def test_views_have_shape_dtype_and_aligned_addresses():
    specs = [TensorSpec("w", (17, 257), torch.bfloat16), TensorSpec("s", (), torch.float32)]
    layout = plan_block_layout(specs)
    buffer = aligned_empty(layout.nbytes, torch.device("cpu"))
    views = [view_placement(buffer, p) for p in layout.placements]
    assert views[0].shape == (17, 257) and views[0].dtype == torch.bfloat16
    assert views[1].shape == () and views[1].dtype == torch.float32
    assert all(v.data_ptr() % ALIGNMENT == 0 for v in views)


def test_aligned_empty_starts_aligned_for_several_sizes():
    for nbytes in (1, 511, 512, 4097):
        assert aligned_empty(nbytes, torch.device("cpu")).data_ptr() % ALIGNMENT == 0


def test_copy_tasks_are_balanced_across_threads():
    from dlo.host.tensor_source import CopyTask, balanced_batches

    sizes = [80, 10, 10, 30, 30, 40]  # bytes: 200 in all
    tasks = [CopyTask(torch.empty(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)) for n in sizes]
    batches = balanced_batches(tasks, 3)
    loads = sorted(sum(t.source.numel() for t in batch) for batch in batches)
    assert loads == [60, 60, 80]  # 80 | 40+10+10 | 30+30
    assert sorted(id(t) for b in batches for t in b) == sorted(id(t) for t in tasks)
    assert len(balanced_batches(tasks[:2], 8)) == 2
