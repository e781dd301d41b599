"""Build random tiny DeepseekV3ForCausalLM models in Hugging Face transformers (the reference)."""
from __future__ import annotations

import numpy as np


def make_hf_checkpoint(path, seed: int = 0, **overrides):
    """Save a random DeepseekV3ForCausalLM (float32) to `path`; returns the torch model (eval mode).

    Every parameter is re-drawn (not HF's init): weights ~ N(0, 0.5/sqrt(fan_in)) so activations stay
    O(1) and logits are spread; norm weights ~ 1 + N(0, 0.1); the router's correction bias ~ N(0, 0.3)
    so that choosing with the bias differs from weighting without it.
    """
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
              q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
              topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
              max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=1)
    kw.update(overrides)
    cfg = DeepseekV3Config(**kw)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()
