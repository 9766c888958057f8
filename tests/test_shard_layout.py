"""Which bytes of a block's padded image each rank holds in all-gather mode (See [Note: chunked gathers])."""

import pytest

from dlo.planning.shard_layout import plan_shards


@pytest.mark.parametrize(
    ("image_bytes", "size", "chunk_bytes", "chunks"),
    [(157696, 2, 0, 1), (157696, 2, 31458, 6), (65536, 2, 65536, 1), (65536, 4, 10000, 7), (1000, 3, 64 << 20, 1)],
)
def test_the_ranks_pieces_tile_the_padded_image_chunk_by_chunk(image_bytes, size, chunk_bytes, chunks):
    shards = plan_shards(image_bytes, size, chunk_bytes)
    assert shards.chunks == chunks
    owners = {}
    for rank in range(size):
        pieces = shards.pieces(rank)
        # A rank's shard is its pieces one after another, in chunk order.
        assert [p.shard_start for p in pieces] == [sum(q.nbytes for q in pieces[:i]) for i in range(len(pieces))]
        assert sum(p.nbytes for p in pieces) == shards.shard_bytes
        for piece in pieces:
            assert piece.image_start % 512 == 0 and piece.nbytes % 512 == 0
            owners[piece.image_start] = (piece.chunk, rank, piece.nbytes)
    # Chunk c is the ranks' pieces in rank order (what one all-gather lands), with no gap or overlap.
    ends = 0
    for start in sorted(owners):
        chunk, rank, nbytes = owners[start]
        assert start == ends and start // (size * nbytes) == chunk and (start // nbytes) % size == rank
        ends = start + nbytes
    assert ends == shards.padded_bytes >= image_bytes
    assert shards.padded_bytes - image_bytes < chunks * size * 512


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        plan_shards(4096, 2, 0).pieces(2)
