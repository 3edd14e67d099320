"""Pure-torch stand-ins for the `vllm._custom_ops` kernels SGLang 0.5.23 calls
on its generic CPU path: rotary_embedding (RotaryEmbedding's fallback
kernel), silu_and_mul and moe_sum (fused MoE's non-CUDA path). Same
signatures and in-place semantics as vLLM's."""

import torch


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """In place: query/key [tokens, heads * head_size] (or [tokens, heads,
    head_size]); the first rot_dim = cos_sin_cache.shape[-1] features of each
    head rotate; cos_sin_cache [max_pos, rot_dim] = [cos | sin]."""
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = cos.unsqueeze(-2).to(query.dtype)
    sin = sin.unsqueeze(-2).to(query.dtype)
    rot = cos_sin_cache.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        v = x.view(n, -1, head_size)
        r = v[..., :rot]
        if is_neox:
            x1, x2 = torch.chunk(r, 2, dim=-1)
        else:
            x1, x2 = r[..., ::2], r[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox:
            out = torch.cat((o1, o2), dim=-1)
        else:
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        r.copy_(out)


def silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])


def moe_sum(input, output):
    output.copy_(input.sum(dim=1))
