"""Original-layout single files made by the tests themselves: a diffusers model's state dict
written in the key layout its original repository uses (Wan 2.1's, Flux's, Flux.2's and Flux.3's BFL layouts, LTX-Video's, Z-Image's,
ComfyUI's Qwen-Image 2.1, HunyuanVideo's), by
mappings written here from those repositories' names (the inverse of what diffusers'
converters do; dlo's own code is not used)."""

import re

import torch

WAN_RENAMES = [  # diffusers -> Wan 2.1 (applied in order, on the key with dots around it)
    (".condition_embedder.time_embedder.linear_1.", ".time_embedding.0."),
    (".condition_embedder.time_embedder.linear_2.", ".time_embedding.2."),
    (".condition_embedder.time_proj.", ".time_projection.1."),
    (".condition_embedder.text_embedder.linear_1.", ".text_embedding.0."),
    (".condition_embedder.text_embedder.linear_2.", ".text_embedding.2."),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".norm2.", ".norm3."),  # Wan's cross-attention norm is its norm3
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".proj_out.", ".head.head."),
]


def wan_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        name = f".{key}."
        for new, old in WAN_RENAMES:
            name = name.replace(new, old)
        name = name.strip(".")
        name = re.sub(r"^scale_shift_table$", "head.modulation", name)
        name = re.sub(r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation", name)
        out[name] = tensor
    return out


FLUX_DOUBLE = {  # diffusers (under transformer_blocks.N.) -> BFL (under double_blocks.N.)
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
FLUX_NORMS = {  # diffusers norm weight -> BFL RMSNorm scale
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
FLUX_TOP = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}


def flux_original(state: dict[str, torch.Tensor], double: int, single: int) -> dict[str, torch.Tensor]:
    out = {}
    for module, original in FLUX_TOP.items():
        for kind in ("weight", "bias"):
            out[f"{original}.{kind}"] = state[f"{module}.{kind}"]
    for kind in ("weight", "bias"):  # BFL keeps shift before scale; diffusers swaps them
        scale, shift = state[f"norm_out.linear.{kind}"].chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat([shift, scale])
    for i in range(double):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            for module, original in FLUX_DOUBLE.items():
                out[f"{b}{original}.{kind}"] = state[f"{d}{module}.{kind}"]
            out[f"{b}img_attn.qkv.{kind}"] = torch.cat([state[f"{d}attn.to_{p}.{kind}"] for p in "qkv"])
            out[f"{b}txt_attn.qkv.{kind}"] = torch.cat([state[f"{d}attn.add_{p}_proj.{kind}"] for p in "qkv"])
        for module, original in FLUX_NORMS.items():
            out[f"{b}{original}.scale"] = state[f"{d}{module}.weight"]
    for i in range(single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{b}modulation.lin.{kind}"] = state[f"{d}norm.linear.{kind}"]
            parts = [state[f"{d}attn.to_{p}.{kind}"] for p in "qkv"] + [state[f"{d}proj_mlp.{kind}"]]
            out[f"{b}linear1.{kind}"] = torch.cat(parts)
            out[f"{b}linear2.{kind}"] = state[f"{d}proj_out.{kind}"]
        out[f"{b}norm.query_norm.scale"] = state[f"{d}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = state[f"{d}attn.norm_k.weight"]
    return out


HUNYUAN_RENAMES = [  # diffusers -> HunyuanVideo (applied in order, on the key with dots around it)
    (".context_embedder.token_refiner.refiner_blocks.", ".txt_in.individual_token_refiner.blocks."),
    (".context_embedder.time_text_embed.timestep_embedder.linear_1.", ".txt_in.t_embedder.mlp.0."),
    (".context_embedder.time_text_embed.timestep_embedder.linear_2.", ".txt_in.t_embedder.mlp.2."),
    (".context_embedder.time_text_embed.text_embedder.", ".txt_in.c_embedder."),
    (".context_embedder.proj_in.", ".txt_in.input_embedder."),
    (".time_text_embed.timestep_embedder.linear_1.", ".time_in.mlp.0."),
    (".time_text_embed.timestep_embedder.linear_2.", ".time_in.mlp.2."),
    (".time_text_embed.guidance_embedder.linear_1.", ".guidance_in.mlp.0."),
    (".time_text_embed.guidance_embedder.linear_2.", ".guidance_in.mlp.2."),
    (".time_text_embed.text_embedder.linear_1.", ".vector_in.in_layer."),
    (".time_text_embed.text_embedder.linear_2.", ".vector_in.out_layer."),
    (".x_embedder.", ".img_in."),
    (".transformer_blocks.", ".double_blocks."),
    (".single_transformer_blocks.", ".single_blocks."),
    (".norm1.linear.", ".img_mod.linear."),
    (".norm1_context.linear.", ".txt_mod.linear."),
    (".attn.norm_added_q.", ".txt_attn_q_norm."),
    (".attn.norm_added_k.", ".txt_attn_k_norm."),
    (".attn.to_add_out.", ".txt_attn_proj."),
    (".ff_context.net.0.proj.", ".txt_mlp.fc1."),
    (".ff_context.net.2.", ".txt_mlp.fc2."),
    (".ff.net.0.proj.", ".mlp.fc1."),  # img_mlp in double blocks (below), mlp in the refiner's
    (".ff.net.2.", ".mlp.fc2."),
    (".norm_out.linear.", ".adaLN_modulation.1."),  # the refiner's; the final one is swapped below
    (".norm.linear.", ".modulation.linear."),
    (".proj_out.", ".linear2."),  # single blocks'; the final one is final_layer.linear
]


def hunyuan_video_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HunyuanVideo's own layout: q/k/v fused (qkv, self_attn_qkv), a single block's q/k/v and
    MLP input fused (linear1), the final norm's shift before its scale."""
    out = {}
    fused = {}  # original key -> diffusers keys, concatenated in order
    for key, tensor in state.items():
        kind = key.rsplit(".", 1)[1]
        if key.startswith("norm_out.linear."):
            scale, shift = tensor.chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{kind}"] = torch.cat([shift, scale])
            continue
        if key.startswith("proj_out."):
            out[f"final_layer.linear.{kind}"] = tensor
            continue
        if key.startswith("single_transformer_blocks.") and re.search(r"\.(attn\.to_[qkv]|proj_mlp)\.", key):
            block = key.split(".")[1]
            fused.setdefault(f"single_blocks.{block}.linear1.{kind}", []).append(key)
            continue
        match = re.match(r"(.*)\.attn\.(to_|add_)[qkv](_proj)?\.(weight|bias)$", key)
        if match:
            where = "self_attn_qkv" if ".refiner_blocks." in key else "img_attn_qkv" if match[2] == "to_" else "txt_attn_qkv"
            fused.setdefault(f"{_hunyuan_renamed(match[1] + '.')}{where}.{kind}", []).append(key)
            continue
        name = "." + _hunyuan_renamed(key)
        if name.startswith(".double_blocks."):
            name = name.replace(".mlp.fc", ".img_mlp.fc").replace(".attn.norm_q.", ".img_attn_q_norm.")
            name = name.replace(".attn.norm_k.", ".img_attn_k_norm.").replace(".attn.to_out.0.", ".img_attn_proj.")
        elif name.startswith(".single_blocks."):
            name = name.replace(".attn.norm_q.", ".q_norm.").replace(".attn.norm_k.", ".k_norm.")
        elif ".individual_token_refiner." in name:
            name = name.replace(".attn.to_out.0.", ".self_attn_proj.")
        out[name[1:]] = tensor
    for key, parts in fused.items():
        out[key] = torch.cat([state[part] for part in sorted(parts, key=lambda part: FUSED_ORDER.index(part.split(".")[-2]))])
    return out


def _hunyuan_renamed(key: str) -> str:
    name = f".{key}"
    for diffusers_part, original in HUNYUAN_RENAMES:
        name = name.replace(diffusers_part, original)
    return name[1:]


FUSED_ORDER = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "proj_mlp")


FLUX2_TOP = {  # diffusers -> Flux.2's BFL names (no biases)
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
FLUX2_DOUBLE = {  # diffusers (under transformer_blocks.N.) -> BFL (under double_blocks.N.)
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
}
FLUX2_SINGLE = {  # diffusers (under single_transformer_blocks.N.) -> BFL (under single_blocks.N.)
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def flux2_original(state: dict[str, torch.Tensor], double: int, single: int) -> dict[str, torch.Tensor]:
    """Flux.2's BFL layout: each stream's q, k and v in one `qkv`, the final modulation's
    shift before its scale (diffusers keeps scale first)."""
    out = {f"{original}.weight": state[f"{module}.weight"] for module, original in FLUX2_TOP.items()}
    out["final_layer.adaLN_modulation.1.weight"] = _swapped_halves(state["norm_out.linear.weight"])
    for i in range(double):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out.update({f"{b}{original}": state[f"{d}{name}"] for name, original in FLUX2_DOUBLE.items()})
        out[f"{b}img_attn.qkv.weight"] = torch.cat([state[f"{d}attn.to_{p}.weight"] for p in "qkv"])
        out[f"{b}txt_attn.qkv.weight"] = torch.cat([state[f"{d}attn.add_{p}_proj.weight"] for p in "qkv"])
    for i in range(single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out.update({f"{b}{original}": state[f"{d}{name}"] for name, original in FLUX2_SINGLE.items()})
    return {key: tensor.contiguous() for key, tensor in out.items()}


LTX_RENAMES = [("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"), ("norm_k", "k_norm")]


def ltx_original(state: dict[str, torch.Tensor], vae: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LTX-Video's own single file: the transformer under `model.diffusion_model.` with its own
    names, and the VAE's tensors beside it under `vae.`."""
    out = {}
    for key, tensor in state.items():
        for new, old in LTX_RENAMES:
            key = key.replace(new, old)
        out[f"model.diffusion_model.{key}"] = tensor
    return {**out, **{f"vae.{key}": tensor for key, tensor in vae.items()}}


LTX2_RENAMES = [  # diffusers -> LTX-2's own names (anywhere in the key)
    ("proj_in", "patchify_proj"),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
    ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
    ("norm_q", "q_norm"),
    ("norm_k", "k_norm"),
]
LTX2_STARTS = [("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single.")]


def ltx2_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LTX-2's own layout (renames only), with the text connectors' tensors beside the
    transformer's, as its files hold them (diffusers' converter drops them)."""
    out = {}
    for key, tensor in state.items():
        for new, old in LTX2_RENAMES:
            key = key.replace(new, old)
        for new, old in LTX2_STARTS:
            key = old + key.removeprefix(new) if key.startswith(new) else key
        out[key] = tensor.contiguous()
    out["video_embeddings_connector.learnable_registers"] = torch.ones(4, 8, dtype=torch.bfloat16)
    out["audio_embeddings_connector.learnable_registers"] = torch.ones(4, 8, dtype=torch.bfloat16)
    return out


Z_IMAGE_RENAMES = [  # diffusers -> Z-Image's own names (on the key with a dot in front)
    (".all_final_layer.2-1.", ".final_layer."),
    (".all_x_embedder.2-1.", ".x_embedder."),
    (".attention.to_out.0.", ".attention.out."),
    (".attention.norm_k.", ".attention.k_norm."),
    (".attention.norm_q.", ".attention.q_norm."),
]


def z_image_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Z-Image's own layout: each attention's q, k and v in one `qkv`."""
    out = {}
    for key, tensor in state.items():
        if key.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            continue
        if key.endswith(".attention.to_q.weight"):
            tensor = torch.cat([state[key.replace("to_q", f"to_{p}")] for p in "qkv"])
            key = key.replace("to_q", "qkv")
        name = f".{key}"
        for new, old in Z_IMAGE_RENAMES:
            name = name.replace(new, old)
        out[name[1:]] = tensor.contiguous()
    return out


def qwen_image21_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen-Image 2.1 as ComfyUI writes it: each block's SwiGLU gate and up projections fused
    into one `gate_up`, gate rows first (the other names are diffusers')."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(".img_mlp.proj.weight"):
            continue
        if key.endswith(".img_mlp.gate_layer.weight"):
            tensor = torch.cat([tensor, state[key.replace("gate_layer", "proj")]])
            key = key.replace("gate_layer", "gate_up")
        out[key] = tensor.contiguous()
    return out


FLUX3_EXACT = {  # diffusers -> Flux.3's own names, whole keys
    "timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "proj_out.weight": "final_layer.image.linear.weight",
}
FLUX3_PREFIXES = {"x_embedders.": "emb_in.", "context_embedder.": "txt_in.", "mode_blocks.": "content_mode_blocks.",
                  "single_transformer_blocks.": "single_blocks."}
FLUX3_SUFFIXES = {  # diffusers -> Flux.3, the end of a block's key
    "attn.to_q.weight": "q_proj.weight", "attn.to_k.weight": "k_proj.weight", "attn.to_v.weight": "v_proj.weight",
    "attn.to_out.0.weight": "attn_out.weight", "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale", "ff.linear_in.weight": "mlp_in.weight", "ff.linear_out.weight": "mlp_out.weight",
}


def flux3_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flux.3's own layout: renames, and the final modulation's shift before its scale."""
    out = {"final_layer.image.adaLN_modulation.1.weight": _swapped_halves(state["norm_out.linear.weight"])}
    for key, tensor in state.items():
        if key == "norm_out.linear.weight":
            continue
        if key in FLUX3_EXACT:
            out[FLUX3_EXACT[key]] = tensor
            continue
        prefix = next((p for p in FLUX3_PREFIXES if key.startswith(p)), None)
        name = FLUX3_PREFIXES[prefix] + key[len(prefix):] if prefix else key
        name = name.replace(".linear.weight", ".lin.weight")
        suffix = next((s for s in FLUX3_SUFFIXES if name.endswith(s)), None)
        out[name[: -len(suffix)] + FLUX3_SUFFIXES[suffix] if suffix else name] = tensor
    return {key: tensor.contiguous() for key, tensor in out.items()}


MINIMAX_H3_RENAMES = [  # diffusers -> MiniMax-H3 (applied in order, on the key with a dot in front)
    (".transformer_blocks.", ".blocks."),
    (".token_refiner.refiner_blocks.", ".token_refiner.blocks."),
    (".proj_in.", ".video_patch_proj."),  # before the time embedder's own proj_in is named
    (".proj_out.", ".final_layer.video_out."),
    (".time_embedder.linear_1.", ".time_embedder.proj_in."),
    (".time_embedder.linear_2.", ".time_embedder.proj_out."),
    (".audio_proj_in.", ".audio_patch_proj."),
    (".context_embedder.", ".condition_proj."),
    (".norm_out.norm.", ".final_layer.norm."),
    (".norm_out.linear.", ".final_layer.adaln_proj.linear."),
    (".audio_proj_out.", ".final_layer.audio_out."),
    (".attn.norm_q.", ".attn.q_norm."),
    (".attn.norm_k.", ".attn.k_norm."),
    (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."),
    (".ff.net.2.", ".mlp.fc2."),
]


def minimax_h3_original(state: dict[str, torch.Tensor], heads: int, head_dim: int, qkv_layout: str) -> dict[str, torch.Tensor]:
    """MiniMax-H3's layout: q, k and v in one `qkv_proj` whose rows are `[q; k; v]` ("stacked",
    the published single files) or `[q k v]` head by head ("interleaved", the original shards),
    and the gated MLP's input projection `[gate; value]` where diffusers reads `[value; gate]`."""
    out = {}
    for key, tensor in state.items():
        if key.endswith((".attn.to_k.weight", ".attn.to_v.weight")):
            continue
        if key.endswith(".attn.to_q.weight"):
            q, k, v = (state[key.replace("to_q", f"to_{p}")] for p in "qkv")
            if qkv_layout == "interleaved":
                tensor = torch.stack([t.unflatten(0, (heads, head_dim)) for t in (q, k, v)], dim=1).flatten(0, 2)
            else:
                tensor = torch.cat([q, k, v])
            key = key.replace("to_q", "qkv_proj")
        elif key.endswith(".ff.net.0.proj.weight"):
            value, gate = tensor.chunk(2, dim=0)
            tensor = torch.cat([gate, value])
        name = f".{key}"
        for new, old in MINIMAX_H3_RENAMES:
            name = name.replace(new, old)
        out[name[1:]] = tensor.contiguous()
    return out


SD3_TOP = {  # diffusers -> SD3's own names (and pos_embed.pos_embed -> pos_embed)
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
}
SD3_BLOCK = {  # diffusers (under transformer_blocks.N.) -> SD3 (under joint_blocks.N.)
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}


def _swapped_halves(tensor: torch.Tensor) -> torch.Tensor:
    """SD3 and Flux.2 keep an output-norm modulation as [shift; scale], diffusers as [scale; shift]."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def sd3_original(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """SD3's own layout (joint blocks, fused q/k/v) without the dual attention or q/k norms."""
    out = {}
    for module, original in SD3_TOP.items():
        for kind in ("weight", "bias"):
            if f"{module}.{kind}" in state:
                out[f"{original}.{kind}"] = state[f"{module}.{kind}"]
    out["pos_embed"] = state["pos_embed.pos_embed"]
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swapped_halves(state[f"norm_out.linear.{kind}"])
    for i in range(layers):
        d, b = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        last = i == layers - 1
        for kind in ("weight", "bias"):
            for module, original in SD3_BLOCK.items():
                if f"{d}{module}.{kind}" in state:
                    out[f"{b}{original}.{kind}"] = state[f"{d}{module}.{kind}"]
            if last:  # the last block's context norm is an output norm
                out[f"{b}context_block.adaLN_modulation.1.{kind}"] = _swapped_halves(state[f"{d}norm1_context.linear.{kind}"])
            out[f"{b}x_block.attn.qkv.{kind}"] = torch.cat([state[f"{d}attn.to_{p}.{kind}"] for p in "qkv"])
            out[f"{b}context_block.attn.qkv.{kind}"] = torch.cat([state[f"{d}attn.add_{p}_proj.{kind}"] for p in "qkv"])
    return {key: tensor.contiguous() for key, tensor in out.items()}
