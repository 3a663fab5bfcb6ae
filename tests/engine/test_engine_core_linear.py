"""oneDNN-packed linears and fused gated MLPs compute what the modules they replace compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from slotserve.engine.core.model.fusion import FusedGatedMLP, QKVPart, fuse_gated_mlps, fuse_qkv
from slotserve.engine.core.model.linear import PackedLinear, onednn_supported, pack_linears

pytestmark = pytest.mark.skipif(
    not onednn_supported(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48)])
def test_packed_linear_matches_nn_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected = linear(x)
        got = packed(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fused_gated_mlp_matches_llama_mlp():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=96)
    holder = nn.Module()
    holder.mlp = LlamaMLP(config)
    original = holder.mlp
    x = torch.randn(3, 4, 32)
    with torch.inference_mode():
        expected = original(x)
        assert fuse_gated_mlps(holder) == 1
        assert isinstance(holder.mlp, FusedGatedMLP)
        got = holder.mlp(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mlp_with_other_forward_is_left_alone():
    class OddMLP(nn.Module):  # the right attributes, but not a known forward
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(8, 16, bias=False)
            self.up_proj = nn.Linear(8, 16, bias=False)
            self.down_proj = nn.Linear(16, 8, bias=False)
            self.act_fn = nn.SiLU()

    holder = nn.Module()
    holder.mlp = OddMLP()
    assert fuse_gated_mlps(holder) == 0


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_matches_separate_projections_in_any_call_order(bias):
    torch.manual_seed(0)
    attn = nn.Module()
    attn.q_proj = nn.Linear(32, 32, bias=bias)
    attn.k_proj = nn.Linear(32, 16, bias=bias)
    attn.v_proj = nn.Linear(32, 16, bias=bias)
    originals = [attn.q_proj, attn.k_proj, attn.v_proj]
    x, y = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    with torch.inference_mode():
        assert fuse_qkv(attn, PackedLinear) == 1
        fused = [attn.q_proj, attn.k_proj, attn.v_proj]
        # Shuffled orders, a new input, then the usual order (which releases what it held).
        for order, inp in (([2, 0, 1], x), ([1, 2, 0], y), ([0, 1, 2], x)):
            for i in order:
                torch.testing.assert_close(fused[i](inp), originals[i](inp), rtol=1e-5, atol=1e-5)
    q_proj = fused[0]
    assert isinstance(q_proj, QKVPart) and q_proj.shared.parts == ()  # nothing held between steps


@pytest.fixture
def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_pack_linears_keeps_logits_and_tied_embedding(tiny_llama):
    ids = torch.randint(0, 300, (1, 9))
    with torch.inference_mode():
        hidden = tiny_llama.model(input_ids=ids).last_hidden_state
        expected = tiny_llama.lm_head(hidden)
        logits = pack_linears(tiny_llama, "onednn", max_rows=4)
        assert logits is not None
        packed_hidden = tiny_llama.model(input_ids=ids).last_hidden_state
        got = logits(packed_hidden)
    layer = tiny_llama.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QKVPart)
    assert isinstance(layer.self_attn.o_proj, PackedLinear)
    assert isinstance(layer.mlp, FusedGatedMLP)
    assert not any(type(m) is nn.Linear for m in tiny_llama.model.modules())
    # The tied output matrix is still the input embedding's.
    assert tiny_llama.lm_head.weight is tiny_llama.model.embed_tokens.weight
    torch.testing.assert_close(packed_hidden, hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_aten_backend_packs_nothing_and_fuses_with_the_same_result(tiny_llama):
    ids = torch.randint(0, 200, (1, 9))
    with torch.inference_mode():
        expected = tiny_llama(ids).logits
    assert pack_linears(tiny_llama, "aten", max_rows=4) is None
    attention = tiny_llama.model.layers[0].self_attn
    # Stock products, fewer of them: q/k/v one product, gate/up one.
    assert type(attention.q_proj.shared.linear) is nn.Linear
    assert type(attention.o_proj) is nn.Linear
    assert not any(isinstance(m, PackedLinear) for m in tiny_llama.modules())
    with torch.inference_mode():
        torch.testing.assert_close(tiny_llama(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_auto_backend_decides_by_measurement(tiny_llama):
    logits = pack_linears(tiny_llama, "auto", max_rows=8)
    packed = isinstance(tiny_llama.model.layers[0].self_attn.o_proj, PackedLinear)
    # Either choice is valid on some machine; they must agree with each other.
    assert packed == (logits is not None)


def test_auto_backend_falls_back_when_onednn_fails(tiny_llama, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    assert pack_linears(tiny_llama, "auto", max_rows=8) is None
    assert type(tiny_llama.model.layers[0].self_attn.o_proj) is nn.Linear
    assert "oneDNN linear failed in calibration" in caplog.text


def test_runners_of_other_batch_sizes_share_the_prepared_native_logits(tiny_llama):
    # Benchmarks build one runner per batch size on one model: the model is prepared once and
    # every runner computes logits as the first did (native, the rows it was prepared for), not
    # through aten, with no second calibration.
    from slotserve.engine.core.kernels import load_kernels
    from slotserve.engine.core.model.native_linear import NativeLinear
    from slotserve.engine.core.model.prepare import prepare_model
    from slotserve.engine.core.model.runner import ModelRunner
    from slotserve.settings import CommonSettings

    kernels = load_kernels(CommonSettings().home)
    prepared = prepare_model(tiny_llama, kernels, max_rows=6, linear_backend="native")
    first = ModelRunner(prepared, num_slots=6, max_model_len=32)
    second = ModelRunner(prepared, num_slots=2, max_model_len=32)
    assert isinstance(first.logits, NativeLinear) and second.logits is first.logits
    assert second.logits.max_native_rows == 6
    assert second.calibrations == first.calibrations == prepared.calibrations
    assert [record.name for record in prepared.calibrations] == ["native_kernels"]
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(second.logits(hidden), hidden @ tiny_llama.lm_head.weight.T)
