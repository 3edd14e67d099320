"""An independent reference of Megatron-Core's parameter layouts (Transformer
Engine layer spec), written from the facts of issue 15 and docs/megatron.md,
never from weightsync's C++: what each rank of a Megatron job holds, under
Megatron's names, built from full HF tensors with plain torch operations.

    rank_params(config, sizes, hf, rank) -> {megatron name: tensor}

`config` is the HF config dict, `sizes` {"pp", "tp", "dp", "cp", "ep",
"etp"}, `hf` {hf_key: tensor} (a transformers checkpoint), `rank` the global
rank in Megatron's order tp-cp-ep-dp-pp.
"""

from __future__ import annotations

import torch


def coords(sizes: dict, rank: int) -> dict:
    """Megatron's ranks: dense grid tp (fastest), cp, dp, then pp; expert grid
    etp (fastest), ep, edp over the same ranks of a stage."""
    tp, cp, dp = sizes["tp"], sizes["cp"], sizes["dp"]
    stage_size = tp * cp * dp
    pp_rank, i = divmod(rank, stage_size)
    etp = sizes["etp"]
    return {"pp": pp_rank, "tp": i % tp, "etp": i % etp, "ep": (i // etp) % sizes["ep"]}


def stage_layers(num_layers: int, pp: int, first: int | None, last: int | None) -> list:
    """Layers per stage (get_num_layers_to_build): even, or the first / last
    stage given and the middle ones even."""
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"{num_layers} layers over pp={pp}: Megatron refuses uneven stages")
        return [num_layers // pp] * pp
    middle = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle < 0 or (middle and not middle_stages):
        raise ValueError(f"{middle} layers left with {middle_stages} middle stages: on no stage")
    if middle_stages and middle % middle_stages:  # Megatron's check; 0 per middle stage is fine
        raise ValueError(f"{middle} middle layers over {middle_stages} middle stages")
    out = [middle // middle_stages if middle_stages else 0] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def part(t: torch.Tensor, ways: int, index: int, dim: int = 0) -> torch.Tensor:
    """Part `index` of `ways` equal parts along `dim` (Megatron splits evenly)."""
    if t.shape[dim] % ways:
        raise ValueError(f"{tuple(t.shape)} does not split in {ways} along dim {dim}")
    return t.chunk(ways, dim)[index]


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    if divisible_by <= 0:
        return vocab
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def vocab_part(t: torch.Tensor, rows: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Vocab-parallel rows of `t` padded with zero rows to `rows`."""
    full = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    full[: t.shape[0]] = t
    return part(full, tp, tp_rank)


def grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                groups: int) -> torch.Tensor:
    """Per query group g: its heads/groups query heads, then k head g, then v
    head g (weights and biases alike)."""
    qs, ks, vs = q.chunk(heads), k.chunk(groups), v.chunk(groups)
    per = heads // groups
    rows = []
    for g in range(groups):
        rows += list(qs[g * per:(g + 1) * per]) + [ks[g], vs[g]]
    return torch.cat(rows)


def gate_up(gate: torch.Tensor, up: torch.Tensor, ways: int, index: int) -> torch.Tensor:
    """[gate; up] split so that rank r holds [gate_r; up_r]."""
    return torch.cat([part(gate, ways, index), part(up, ways, index)])


def is_moe_layer(config: dict, layer: int) -> bool:
    kind = config["model_type"]
    if kind == "mixtral":
        return True
    if kind == "qwen3_moe":
        return (layer not in config.get("mlp_only_layers", [])
                and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)
    if kind == "deepseek_v3":
        return (layer >= config.get("first_k_dense_replace", 0)
                and layer % config.get("moe_layer_freq", 1) == 0)
    return False


def num_experts(config: dict) -> int:
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(field):
            return config[field]
    return 0


class _Rank:
    def __init__(self, config: dict, sizes: dict, hf: dict, rank: int, opts: dict):
        self.c, self.s, self.hf, self.o = config, sizes, hf, opts
        self.at = coords(sizes, rank)
        self.out: dict = {}

    def tp(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return part(t, self.s["tp"], self.at["tp"], dim)

    def attention(self, h: str, m: str) -> None:
        hf, c, out = self.hf, self.c, self.out
        if h + "self_attn.kv_a_proj_with_mqa.weight" in hf:  # MLA
            a = h + "self_attn."
            out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
            if a + "q_a_proj.weight" in hf:
                out[m + "self_attention.linear_q_down_proj.weight"] = hf[a + "q_a_proj.weight"]
                out[m + "self_attention.linear_q_up_proj.layer_norm_weight"] = \
                    hf[a + "q_a_layernorm.weight"]
                out[m + "self_attention.linear_q_up_proj.weight"] = self.tp(hf[a + "q_b_proj.weight"])
            else:
                out[m + "self_attention.linear_q_proj.weight"] = self.tp(hf[a + "q_proj.weight"])
            out[m + "self_attention.linear_kv_down_proj.weight"] = \
                hf[a + "kv_a_proj_with_mqa.weight"]
            out[m + "self_attention.linear_kv_up_proj.layer_norm_weight"] = \
                hf[a + "kv_a_layernorm.weight"]
            out[m + "self_attention.linear_kv_up_proj.weight"] = self.tp(hf[a + "kv_b_proj.weight"])
        else:
            heads, groups = c["num_attention_heads"], c["num_key_value_heads"]
            out[m + "self_attention.linear_qkv.layer_norm_weight"] = \
                hf[h + "input_layernorm.weight"]
            for what in ("weight", "bias"):
                q = h + f"self_attn.q_proj.{what}"
                if q in hf:
                    qkv = grouped_qkv(hf[q], hf[h + f"self_attn.k_proj.{what}"],
                                      hf[h + f"self_attn.v_proj.{what}"], heads, groups)
                    # Column parallel: tp equal row blocks, also with more tp ranks
                    # than groups (Megatron all-gathers the QKV activations then).
                    out[m + f"self_attention.linear_qkv.{what}"] = self.tp(qkv)
            if h + "self_attn.q_norm.weight" in hf:
                out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
                out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = self.tp(hf[h + "self_attn.o_proj.weight"], 1)

    def mlp(self, h: str, m: str, layer: int) -> None:
        hf, out, tp, r = self.hf, self.out, self.s["tp"], self.at["tp"]
        if not is_moe_layer(self.c, layer):
            out[m + "mlp.linear_fc1.layer_norm_weight"] = hf[h + "post_attention_layernorm.weight"]
            out[m + "mlp.linear_fc1.weight"] = gate_up(hf[h + "mlp.gate_proj.weight"],
                                                       hf[h + "mlp.up_proj.weight"], tp, r)
            out[m + "mlp.linear_fc2.weight"] = self.tp(hf[h + "mlp.down_proj.weight"], 1)
            return
        mixtral = self.c["model_type"] == "mixtral"
        b = h + ("block_sparse_moe." if mixtral else "mlp.")
        g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.router.weight"] = hf[b + "gate.weight"]
        if b + "gate.e_score_correction_bias" in hf:
            out[m + "mlp.router.expert_bias"] = hf[b + "gate.e_score_correction_bias"]
        local = num_experts(self.c) // self.s["ep"]
        etp, er = self.s["etp"], self.at["etp"]
        for e in range(local):
            x = f"{b}experts.{self.at['ep'] * local + e}."
            out[m + f"mlp.experts.linear_fc1.weight{e}"] = gate_up(
                hf[x + g + ".weight"], hf[x + u + ".weight"], etp, er)
            out[m + f"mlp.experts.linear_fc2.weight{e}"] = part(hf[x + d + ".weight"], etp, er, 1)
        s = b + "shared_experts."
        if s + "gate_proj.weight" in hf:
            out[m + "mlp.shared_experts.linear_fc1.weight"] = gate_up(
                hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"], tp, r)
            out[m + "mlp.shared_experts.linear_fc2.weight"] = self.tp(hf[s + "down_proj.weight"], 1)

    def build(self) -> dict:
        c, s, hf, o, out = self.c, self.s, self.hf, self.o, self.out
        layers = stage_layers(c["num_hidden_layers"], s["pp"], o.get("first"), o.get("last"))
        stage = self.at["pp"]
        rows = padded_vocab(c["vocab_size"], s["tp"], o.get("vocab_divisible_by", 128))
        embed = hf["model.embed_tokens.weight"]
        if stage == 0:
            out["embedding.word_embeddings.weight"] = vocab_part(embed, rows, s["tp"], self.at["tp"])
        first = sum(layers[:stage])
        for local in range(layers[stage]):
            h, m = f"model.layers.{first + local}.", f"decoder.layers.{local}."
            self.attention(h, m)
            self.mlp(h, m, first + local)
        if stage == s["pp"] - 1:
            out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
            if "lm_head.weight" in hf:
                out["output_layer.weight"] = vocab_part(hf["lm_head.weight"], rows, s["tp"],
                                                        self.at["tp"])
            elif s["pp"] > 1:  # tied: the last stage keeps a copy of the embedding
                out["output_layer.weight"] = vocab_part(embed, rows, s["tp"], self.at["tp"])
        return {k: v.contiguous() for k, v in out.items()}


def rank_params(config: dict, sizes: dict, hf: dict, rank: int, **opts) -> dict:
    """What Megatron rank `rank` holds: {name: tensor}. opts: first, last
    (layers of the first / last stage), vocab_divisible_by (default 128)."""
    sizes = {"cp": 1, "dp": 1, "ep": 1, **sizes}
    sizes.setdefault("etp", sizes["tp"])
    return _Rank(config, sizes, hf, rank, opts).build()
