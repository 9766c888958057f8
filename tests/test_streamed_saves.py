"""`save_pretrained` of an enabled model writes its weights (See [Note: saving a streamed model]):
the files equal those the resident model doing the same writes, and what dlo cannot save is
refused before anything is written."""

import copy

import pytest
import torch
from safetensors.torch import load_file

import dlo
from dlo.host.tensor_source import TensorSource
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")

from plain_pipeline import plain_pipeline  # noqa: E402  (needs diffusers)
from test_checkpoint_mmap import ordinary, save  # noqa: E402


def saved(model, directory, **kwargs) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory, **kwargs)
    return tensors(directory)


def tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files in `directory` (safetensors or pickle, sharded or not)."""
    found = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
    for f in sorted(directory.glob("*.bin")):
        found.update(torch.load(f, weights_only=True))
    return found


def same_weight_files(got, expected) -> bool:
    """The two directories hold the same files, the weight files byte for byte (a config
    written from `dlo.load_transformer`'s model lacks the `_name_or_path` of diffusers' loader)."""
    names = sorted(p.name for p in got.iterdir())
    return names == sorted(p.name for p in expected.iterdir()) and all(
        (got / n).read_bytes() == (expected / n).read_bytes() for n in names if n != "config.json"
    )


def assert_same_files(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    differing = [k for k in got if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not differing, differing[:5]


@pytest.mark.parametrize(
    ("name", "config", "safe"),
    [
        ("flux", dlo.OffloadConfig(), True),
        ("flux", dlo.OffloadConfig(), False),
        ("wan", dlo.OffloadConfig(resident_layers=1), True),
        ("sd3", dlo.OffloadConfig(stream_dtype="fp8"), True),
        ("wan", dlo.OffloadConfig(use_allgather=True), True),  # a group of one
    ],
    ids=["flux", "flux-pickle", "wan-resident-layer", "sd3-fp8", "wan-group-of-one"],
)
def test_save_pretrained_writes_what_the_resident_model_writes(tmp_path, tiny_pair, name, config, safe):
    reference, streamed, entry = tiny_pair(name)
    dlo.quantize_resident(reference, config)  # float8: the values the streamed model computes with
    expected = saved(reference, tmp_path / "resident", safe_serialization=safe)
    with dlo.enable(streamed, "cpu", config), torch.inference_mode():
        streamed(**entry.inputs(1))
        got = saved(streamed, tmp_path / "streamed", safe_serialization=safe)
        after = streamed(**entry.inputs(2))[0]  # the save changed nothing
        assert torch.equal(after, reference(**entry.inputs(2))[0])
    assert_same_files(got, expected)
    assert (tmp_path / "streamed" / "config.json").read_text() == (tmp_path / "resident" / "config.json").read_text()


@pytest.mark.parametrize(
    ("torch_dtype", "fuse_qkv", "copies"),
    [(None, False, False), (torch.bfloat16, False, True), (None, True, True)],
    ids=["as-saved", "cast", "fused-qkv"],
)
def test_a_mapped_model_saves_from_views_of_its_files(tmp_path, monkeypatch, torch_dtype, fuse_qkv, copies):
    """Tensors that are ranges of the checkpoint as saved are written from the mapping (no
    private copy); cast and concatenated ones are copied."""
    directory = save(tmp_path, "flux")
    dtype = torch_dtype or torch.float32
    expected = saved(ordinary(directory, "flux", dtype, fuse_qkv=fuse_qkv), tmp_path / "resident")
    model, plan = dlo.load_transformer(directory, torch_dtype=torch_dtype, fuse_qkv=fuse_qkv)
    checkpoint = plan.peek().checkpoint
    with dlo.enable(model, "cpu", plan=plan):
        materialized, read = [], []
        materialize, readable = TensorSource.materialize, TensorSource.readable
        monkeypatch.setattr(TensorSource, "materialize", lambda self, c: materialized.append(self) or materialize(self, c))
        monkeypatch.setattr(TensorSource, "readable", lambda self, c: read.append(readable(self, c)) or read[-1])
        got = saved(model, tmp_path / "streamed")
        assert bool(materialized) == copies
        in_the_file = {checkpoint.holds(value) for value in read}  # views of the mapping, or private copies
        assert in_the_file == ({False} if torch_dtype else {True, False} if fuse_qkv else {True})
    assert_same_files(got, expected)


@pytest.mark.parametrize("source", ["packed", "mapped"])
@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
def test_sharded_and_pickled_saves_are_byte_identical(tmp_path, source, safe):
    """Each value the save reads in place gets a storage of its own bytes: torch would pickle a
    view's whole storage (a block's host buffer, gaps and all, or the whole mapped file), and
    huggingface_hub would keep the views of one storage in one shard."""
    directory = save(tmp_path, "flux")
    options = dict(max_shard_size="20KB", safe_serialization=safe)
    ordinary(directory, "flux", torch.float32).save_pretrained(tmp_path / "resident", **options)
    if source == "mapped":
        model, plan = dlo.load_transformer(directory)
    else:
        model, plan = ordinary(directory, "flux", torch.float32), None
    with dlo.enable(model, "cpu", plan=plan):
        model.save_pretrained(tmp_path / "streamed", **options)
    assert len(list((tmp_path / "resident").glob("*.safetensors" if safe else "*.bin"))) > 10
    assert same_weight_files(tmp_path / "streamed", tmp_path / "resident")


def test_blocks_on_disk_save_from_their_files(tmp_path):
    directory = save(tmp_path, "wan")
    files = list(directory.glob("*.safetensors"))
    expected = saved(ordinary(directory, "wan", torch.float32), tmp_path / "resident")
    model, plan = dlo.load_transformer(directory)
    budget = sum(f.stat().st_size for f in files) * 0.3 / 2**30
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget), plan=plan) as handle:
        assert handle.stats().disk.blocks
        got = saved(model, tmp_path / "streamed")
    assert_same_files(got, expected)


def test_changed_weights_are_saved_as_changed(tmp_path, tiny_pair, tiny_loras):
    """load_state_dict, a fused LoRA, and a block open in handle.editing() with a change not
    yet written back: each saved as the resident model holds it."""
    reference, streamed, entry = tiny_pair("flux")
    other = {k: v * 1.5 for k, v in TINY_MODELS["flux"].build(seed=3).state_dict().items() if "single" in k}
    lora = str(tiny_loras("flux")["a"])
    with dlo.enable(streamed, "cpu") as handle:
        for model in (reference, streamed):
            model.load_state_dict(other, strict=False)
            model.load_lora_adapter(lora, adapter_name="a", prefix="transformer")
            model.fuse_lora(lora_scale=0.7)
        block = streamed.transformer_blocks[0]
        with handle.editing(block), torch.no_grad():
            block.ff.net[2].weight.mul_(0.5)
            reference.transformer_blocks[0].ff.net[2].weight.mul_(0.5)
            for safe in (True, False):  # the open block's tensors are views of one buffer too
                options = dict(max_shard_size="20KB", safe_serialization=safe)
                streamed.save_pretrained(tmp_path / f"streamed-{safe}", **options)
                reference.save_pretrained(tmp_path / f"resident-{safe}", **options)
                assert same_weight_files(tmp_path / f"streamed-{safe}", tmp_path / f"resident-{safe}")


@pytest.mark.parametrize(
    "options", [{}, dict(variant="fp16", safe_serialization=False, max_shard_size="20KB")], ids=["default", "options"]
)
def test_the_pipelines_save_writes_every_streamed_component(tmp_path, tiny_flux_dir, options):
    """pipe.save_pretrained() calls each component's own: the transformer's and the streamed
    text encoders' (transformers models) are dlo's, and get the options diffusers passes to a
    save whose signature names them."""
    encoders = ["text_encoder", "text_encoder_2"]
    plain_pipeline(tiny_flux_dir).save_pretrained(tmp_path / "resident", **options)
    pipe = plain_pipeline(tiny_flux_dir)
    with dlo.enable_pipeline(pipe, "cpu", components=encoders):
        pipe.save_pretrained(tmp_path / "streamed", **options)
    for component in ("transformer", *encoders):
        got, expected = (tmp_path / side / component for side in ("streamed", "resident"))
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in expected.iterdir())
        assert tensors(got), component
        assert_same_files(tensors(got), tensors(expected))


def test_a_model_inside_the_enabled_module_saves_its_weights(tmp_path, tiny_pair):
    reference, streamed, entry = tiny_pair("flux")

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    with dlo.enable(Wrapper(streamed), "cpu"):
        got = saved(streamed, tmp_path / "streamed")
    assert_same_files(got, saved(reference, tmp_path / "resident"))


def test_a_save_from_inside_a_call_leaves_the_call_and_the_blocks_as_they_were(tmp_path, tiny_pair):
    """A hook inside a running block saves: the running block holds its values in its slot, and
    the call goes on with them (a save that released the running block made the rest of it NaN)."""
    reference, streamed, entry = tiny_pair("flux")
    options = dict(max_shard_size="20KB", safe_serialization=False)  # the running block's views of its slot
    reference.save_pretrained(tmp_path / "resident", **options)
    with dlo.enable(streamed, "cpu") as handle, torch.inference_mode():
        inside = streamed.transformer_blocks[1].norm1.linear
        hook = inside.register_forward_pre_hook(lambda m, a: streamed.save_pretrained(tmp_path / "streamed", **options))
        got = streamed(**entry.inputs(1))[0]
        hook.remove()
        assert torch.equal(got, reference(**entry.inputs(1))[0])
        assert torch.equal(streamed(**entry.inputs(2))[0], reference(**entry.inputs(2))[0])
        assert handle.stats().resident_blocks == 0  # the save did not make the block look used outside its call
    assert same_weight_files(tmp_path / "streamed", tmp_path / "resident")


def test_a_save_in_a_group_of_one_costs_the_next_call_nothing(tmp_path, tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(use_allgather=True)) as handle, torch.inference_mode():
        streamed(**entry.inputs(1))
        per_call = []
        for save_first in (False, True):
            if save_first:
                streamed.save_pretrained(tmp_path / "streamed")
            before = handle.stats().bytes_streamed
            streamed(**entry.inputs(1))
            per_call.append(handle.stats().bytes_streamed - before)
    assert per_call[0] == per_call[1] > 0


@pytest.mark.parametrize("case", ["fp8_compute", "disabled_without_restore", "replaced_weight"])
def test_what_cannot_be_saved_is_refused_before_anything_is_written(tmp_path, tiny_pair, case):
    reference, streamed, entry = tiny_pair("flux", dtype=torch.bfloat16)
    config = dlo.OffloadConfig()
    if case == "fp8_compute":
        config = dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True)
        message = r"with fp8_compute the streamed blocks' Linears run as FP8 GEMMs.*call handle.disable\(\) first"
    handle = dlo.enable(streamed, "cpu", config)
    if case == "disabled_without_restore":
        handle.disable(restore=False)
        message = "was disabled with restore=False: its streamed blocks hold no weights; load the model again"
    elif case == "replaced_weight":
        weight = streamed.transformer_blocks[0].ff.net[2].weight
        weight.data = torch.zeros_like(reference.transformer_blocks[0].ff.net[2].weight)
        message = r"'transformer_blocks.0.ff.net.2.weight' was written in place or given a new tensor"
    with pytest.raises(dlo.StreamingError, match=message):
        streamed.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    handle.disable()
    if case != "disabled_without_restore":  # a plain module again: the class's own save
        assert "save_pretrained" not in vars(streamed)


@pytest.mark.parametrize("case", ["emptied", "replaced_weight", "pipeline_emptied"])
def test_a_pipelines_save_refused_for_one_component_writes_nothing(tmp_path, tiny_flux_dir, case):
    """Every streamed component's save is checked first (what it refuses outright, and what
    settling its changes refuses): the VAE and the encoders come before the transformer."""
    pipe = plain_pipeline(tiny_flux_dir)
    handle = dlo.enable_pipeline(pipe, "cpu", components=["text_encoder_2"])
    if case == "emptied":
        handle.handles["transformer"].disable(restore=False)
        message = "was disabled with restore=False"
    elif case == "replaced_weight":
        weight = pipe.transformer.transformer_blocks[0].ff.net[2].weight
        weight.data = torch.zeros(weight.shape, dtype=weight.dtype)
        message = "'transformer_blocks.0.ff.net.2.weight' was written in place or given a new tensor"
    else:
        handle.disable(restore=False)
        message = "was disabled with restore=False"
    with pytest.raises(dlo.StreamingError, match=message):
        pipe.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    handle.disable()
    assert ("save_pretrained" in vars(pipe)) == (case == "pipeline_emptied")  # refused for good there


def test_a_state_dict_argument_of_stand_ins_is_refused(tmp_path, tiny_flux_dir):
    """transformers' save_pretrained takes state_dict=; `state_dict()` of a streamed model holds
    the stand-ins."""
    pipe = plain_pipeline(tiny_flux_dir)
    with dlo.enable_pipeline(pipe, "cpu", components=["text_encoder_2"]):
        encoder = pipe.text_encoder_2
        with pytest.raises(dlo.StreamingError, match="state_dict= holds streamed blocks' stand-ins"):
            encoder.save_pretrained(tmp_path / "out", state_dict=encoder.state_dict())
        with pytest.raises(dlo.StreamingError, match="state_dict= holds streamed blocks' stand-ins"):
            encoder.save_pretrained(tmp_path / "out", True, encoder.state_dict())  # (directory, is_main_process, state_dict)
        assert not (tmp_path / "out").exists()
        encoder.save_pretrained(tmp_path / "out", state_dict={k: v.clone() for k, v in encoder.state_dict().items() if "shared" in k})
        assert tensors(tmp_path / "out").keys() == {"shared.weight"}  # real tensors: saved as given


def test_adapters_a_direct_unmerge_lost_refuse_the_save(tmp_path, tiny_pair, tiny_loras):
    """PEFT's class unmerge called directly pops the adapter before its write into the
    stand-in fails: the weights still hold it, so the save is refused as the next call is."""
    reference, streamed, entry = tiny_pair("flux")
    with dlo.enable(streamed, "cpu"):
        streamed.load_lora_adapter(str(tiny_loras("flux")["a"]), adapter_name="a", prefix="transformer")
        streamed.fuse_lora()
        layer = streamed.transformer_blocks[0].attn.to_q
        with pytest.raises(RuntimeError):
            type(layer).unmerge(layer)
        with pytest.raises(dlo.StreamingError, match="dropped merged adapters"):
            streamed.save_pretrained(tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_empty_tensors_in_a_block_save_as_the_resident_models_do(tmp_path, tiny_pair):
    """A zero-element tensor viewed in a host buffer has an address another tensor of the block
    starts at, which torch refuses to pickle beside it."""
    reference, _, entry = tiny_pair("flux")
    block = reference.transformer_blocks[0]
    block.register_parameter("empty", torch.nn.Parameter(torch.zeros(0, 4)))
    block.register_buffer("empty_half", torch.zeros(0, dtype=torch.float16))
    streamed = copy.deepcopy(reference)
    with dlo.enable(streamed, "cpu"):
        for safe in (True, False):
            streamed.save_pretrained(tmp_path / f"streamed-{safe}", safe_serialization=safe)
            reference.save_pretrained(tmp_path / f"resident-{safe}", safe_serialization=safe)
            assert same_weight_files(tmp_path / f"streamed-{safe}", tmp_path / f"resident-{safe}")


def test_a_submodule_without_streamed_tensors_keeps_its_own_save(tmp_path, tiny_pair):
    """Only modules holding streamed tensors get dlo's save, and its refusals."""
    from diffusers import ConfigMixin, ModelMixin

    class Small(ModelMixin, ConfigMixin):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    reference, streamed, entry = tiny_pair("flux", dtype=torch.bfloat16)

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.small = streamed, Small()

    wrapper = Wrapper()
    handle = dlo.enable(wrapper, "cpu", dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True))
    for restore, refusal in ((None, "with fp8_compute"), (False, "was disabled with restore=False")):
        if restore is not None:
            handle.disable(restore=restore)
        assert "save_pretrained" not in vars(wrapper.small)
        wrapper.small.save_pretrained(tmp_path / f"small-{restore}")
        assert tensors(tmp_path / f"small-{restore}").keys() == {"linear.weight", "linear.bias"}
        with pytest.raises(dlo.StreamingError, match=refusal):
            streamed.save_pretrained(tmp_path / "inner")


def test_a_save_after_disable_is_the_class_own(tmp_path, tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    dlo.enable(streamed, "cpu").disable()
    assert "save_pretrained" not in vars(streamed)
    assert_same_files(saved(streamed, tmp_path / "streamed"), saved(reference, tmp_path / "resident"))
