"""A tiny-model entry with blocks large enough to measure on a GPU."""

from dlo.models.tiny import TinyModel, _wan_inputs

# Blocks of 8.4 MB in bf16: copies long enough to overlap compute, and well above the
# megabyte or so by which the allocator's peak moves from one enable() to the next.
WAN_MB = TinyModel(
    "wan-8mb-blocks",
    "WanTransformer3DModel",
    dict(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=64, freq_dim=64, ffn_dim=2048, num_layers=8, rope_max_seq_len=32,
    ),
    _wan_inputs(latent=(1, 4, 2, 8, 8), text=(1, 12, 64)),
)
