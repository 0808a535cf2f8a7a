"""Tiny random hybrid models built from transformers' config classes (no download):
Qwen3-Next (gated delta-net beside attention), Bamba and GraniteMoeHybrid (Mamba-2
beside attention). Each builder returns (config, model in eval mode)."""

from __future__ import annotations

import torch


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    return cfg, Qwen3NextForCausalLM(cfg).eval()


def bamba():
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(0)
    cfg = BambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8,
        mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, max_position_embeddings=128,
    )  # fmt: skip
    return cfg, BambaForCausalLM(cfg).eval()


def granite_hybrid():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    cfg = GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"] * 2,
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        max_position_embeddings=128,
    )  # fmt: skip
    return cfg, GraniteMoeHybridForCausalLM(cfg).eval()
