"""The Pallas flash-attention kernel behind `attn_implementation="pallas"`: its numerics in Pallas
interpret mode on CPU against transformers' eager attention, forward and backward, through whole
GPT-2 and Llama models (small shapes); and what it refuses."""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

if importlib.util.find_spec("jax") is None:
    pytest.skip("jax 0.7.1 is not installed: `pip install -e .[tpu-aot]`", allow_module_level=True)

from xla_fsdp import attention  # noqa: E402
from xla_fsdp.attention import rules  # noqa: E402
from xla_fsdp.attention.kernel import interpret_on_cpu  # noqa: E402

SEQ = 128  # the kernel's smallest sequence


def _pair(build, config):
    """The same randomly initialized model twice: eager attention and the kernel."""
    attention.register()
    torch.manual_seed(0)
    eager_config, kernel_config = copy.deepcopy(config), copy.deepcopy(config)
    eager_config._attn_implementation = "eager"
    kernel_config._attn_implementation = attention.NAME
    eager, kernel = build(eager_config), build(kernel_config)
    kernel.load_state_dict(eager.state_dict())
    return eager.train(), kernel.train()


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_parity(eager, kernel, vocab):
    ids = torch.randint(vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(eager, ids)
    with interpret_on_cpu():
        got_loss, got = _loss_and_grads(kernel, ids)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2e-4, atol=2e-5, msg=name)


def test_gpt2_with_the_interpreted_kernel_matches_eager_attention_forward_and_backward():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=128, n_head=2, n_layer=1, bos_token_id=0, eos_token_id=0,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    _assert_parity(*_pair(GPT2LMHeadModel, config), config.vocab_size)


def test_gpt2_head_major_projections_with_the_kernel_match_eager_attention():
    # [Note: head-major projections]: the same weights read head-major, einsums around the kernel
    from transformers import GPT2Config, GPT2LMHeadModel
    from xla_fsdp.attention.gpt2_heads import HeadMajorGPT2Attention, use_head_major

    config = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=128, n_head=2, n_layer=2, bos_token_id=0, eos_token_id=0,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    eager, kernel = _pair(GPT2LMHeadModel, config)
    assert use_head_major(kernel) == 2 and use_head_major(kernel) == 0  # once per attention module
    assert isinstance(kernel.transformer.h[0].attn, HeadMajorGPT2Attention)
    assert list(kernel.state_dict()) == list(eager.state_dict())
    _assert_parity(eager, kernel, config.vocab_size)


def test_llama_grouped_query_attention_with_the_interpreted_kernel_matches_eager():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                         attention_dropout=0.0)
    _assert_parity(*_pair(LlamaForCausalLM, config), config.vocab_size)


def test_kernel_refuses_attention_dropout_by_setting():
    from transformers import GPT2Config

    with pytest.raises(rules.KernelInputError, match="attn_pdrop=0.1.*set attn_pdrop to 0"):
        attention.check_config(GPT2Config(attn_pdrop=0.1))
    attention.check_config(GPT2Config(attn_pdrop=0.0))
    q = torch.zeros(1, 1, SEQ, 64)
    with pytest.raises(rules.KernelInputError, match="dropout 0.1"):
        attention.pallas_attention(torch.nn.Module(), q, q, q, None, dropout=0.1)


@pytest.mark.parametrize("seq", [64, 200, 384, 640, 1536])
def test_kernel_refuses_sequence_lengths_its_blocks_do_not_divide(seq):
    q = torch.zeros(1, 1, seq, 64)
    with pytest.raises(rules.KernelInputError, match=f"sequence length {seq}.*--block_size"):
        attention.pallas_attention(torch.nn.Module(), q, q, q, None)


@pytest.mark.parametrize("seq", [128, 256, 512, 1024, 2048, 4096])
def test_kernel_takes_the_sequence_lengths_it_compiles_for(seq):
    assert rules.sequence_problem(seq) is None


def test_kernel_refuses_head_dims_above_256_and_padding_masks():
    q = torch.zeros(1, 1, SEQ, 512)
    with pytest.raises(rules.KernelInputError, match="head dim 512.*n_head"):
        attention.pallas_attention(torch.nn.Module(), q, q, q, None)
    q = torch.zeros(1, 1, SEQ, 64)
    with pytest.raises(rules.KernelInputError, match="attention_mask"):
        attention.pallas_attention(torch.nn.Module(), q, q, q, torch.zeros(1, 1, SEQ, SEQ))


def test_a_padding_mask_given_to_the_model_is_refused_not_dropped():
    from transformers import GPT2Config, GPT2LMHeadModel

    _, kernel = _pair(GPT2LMHeadModel, GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=128, n_head=2, n_layer=1,
                                                  bos_token_id=0, eos_token_id=0, attn_pdrop=0.0))
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    with interpret_on_cpu(), pytest.raises(rules.KernelInputError, match="attention_mask"):
        kernel(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_kernel_requested_on_cpu_outside_the_check_is_refused():
    q = torch.zeros(1, 1, SEQ, 64)
    with pytest.raises(rules.KernelInputError, match="needs a TPU; this runs on cpu.*eager.*xla_fsdp.aot"):
        attention.pallas_attention(torch.nn.Module(), q, q, q, None)


def test_block_sizes_are_torch_xlas():
    from torch_xla.experimental.custom_kernel import FlashAttention

    theirs = {k: v for k, v in FlashAttention.DEFAULT_BLOCK_SIZES.items() if k != "block_b"}
    assert theirs == rules.SEQUENCE_BLOCKS
    assert FlashAttention.MIN_BLOCK_SIZE == rules.MIN_SEQUENCE


def test_llama_head_major_projections_with_the_kernel_match_eager_attention():
    # [Note: head-major Llama projections]: grouped-query attention, biases on, two layers
    from transformers import LlamaConfig, LlamaForCausalLM
    from xla_fsdp.attention.llama_heads import HeadMajorLlamaAttention, use_head_major

    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.0, attention_bias=True)
    eager, kernel = _pair(LlamaForCausalLM, config)
    with torch.no_grad():  # biases away from zero, so a bias read in the wrong layout shows
        for name, p in kernel.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    eager.load_state_dict(kernel.state_dict())
    assert use_head_major(kernel) == 2 and use_head_major(kernel) == 0  # once per attention module
    assert isinstance(kernel.model.layers[1].self_attn, HeadMajorLlamaAttention)
    assert list(kernel.state_dict()) == list(eager.state_dict())
    _assert_parity(eager, kernel, config.vocab_size)
