import torch.nn.functional as F


class FusedSDPA:
    """Reference semantics of Habana's fused scaled dot-product attention (forward only)."""

    @staticmethod
    def apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *args):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)
