"""All-gather mode: which bytes of a block's (padded) wire image each rank of the group holds.

[Note: chunked gathers]
A block is gathered in `chunks` collectives, so that the H2D of a rank's piece of chunk i+1
runs on the copy stream while chunk i is gathered on the communication stream (one
collective of the whole block would wait for the whole H2D first). An all-gather lands its
inputs one after another in rank order, so chunk c of the padded image is G equal pieces,
rank r's at [(c*G + r)*W, (c*G + r + 1)*W), and a rank's host shard is its pieces one after
another: each chunk's H2D is one contiguous copy, and a load is `chunks` collectives of G*W
bytes. W is 512-aligned (See [Note: 512-byte alignment]) and the same for every chunk, so the
padding (zeros past the image's end) is under G*512 bytes per chunk. Unchunked is one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.planning.block_layout import align_up


@dataclass(frozen=True)
class ShardPiece:
    """One rank's bytes of one chunk: [image_start, image_start + nbytes) of the padded block
    image, held at [shard_start, shard_start + nbytes) of the rank's host shard."""

    chunk: int
    image_start: int
    shard_start: int
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    """A block's wire image of `image_bytes` split over `size` ranks in `chunks` chunks of
    `size` pieces of `width` bytes each. See [Note: chunked gathers]"""

    image_bytes: int
    size: int
    chunks: int
    width: int

    @property
    def shard_bytes(self) -> int:
        """What each rank holds on the host and copies per load."""
        return self.chunks * self.width

    @property
    def chunk_bytes(self) -> int:
        """What one collective lands in the slot."""
        return self.size * self.width

    @property
    def padded_bytes(self) -> int:
        """The gathered image: the block's wire image and the padding after it."""
        return self.chunks * self.chunk_bytes

    def pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The one definition of the byte ranges of the padded image that belong to `rank`, in
        chunk order (the order of its host shard). Ranges past `image_bytes` are padding."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a group of {self.size}")
        return tuple(
            ShardPiece(c, (c * self.size + rank) * self.width, c * self.width, self.width) for c in range(self.chunks)
        )


def plan_shards(image_bytes: int, size: int, chunk_bytes: int) -> ShardLayout:
    """The layout of a block's `image_bytes` over `size` ranks, gathered in chunks of at most
    about `chunk_bytes` (0: one chunk). Identical on every rank given the same arguments."""
    chunks = max(1, -(-image_bytes // chunk_bytes)) if chunk_bytes > 0 else 1
    return ShardLayout(image_bytes, size, chunks, align_up(-(-image_bytes // (chunks * size))))
