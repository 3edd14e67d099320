#!/usr/bin/env python3
"""Independent check of `weightsync materialize` against vLLM's loader semantics.

For each tiny model config in configs/models/tiny-*, this script lists the HF
checkpoint's tensors itself, writes a random checkpoint, and builds every
engine rank's parameters the way vLLM's weight loaders do (QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding padded to
64, FusedMoE w13/w2 with and without expert parallel, MLA fused_qkv_a_proj),
then compares names, shapes and every byte with the real binary's output.
Written from DESIGN.md and the engines' documented rules; shares no code with
the C++ side.

usage: materialize_check.py WEIGHTSYNC_BINARY SOURCE_DIR
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError as e:
    print(f"SKIPPED: needs numpy (Debian: python3-numpy): {e}")
    sys.exit(77)


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            b, e = info["data_offsets"]
            out[name] = np.frombuffer(data[8 + n + b : 8 + n + e], dtype=np.uint16).reshape(info["shape"])
    return out


class Model:
    """HF facts of a tiny config, listed independently of the C++ side."""

    def __init__(self, c):
        self.c = c
        self.type = c["model_type"]
        self.H = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads", self.nh)
        self.D = c.get("head_dim", self.H // self.nh)
        self.V = c["vocab_size"]
        self.I = c["intermediate_size"]
        self.tied = c.get("tie_word_embeddings", False)
        self.E = c.get("num_experts", c.get("num_local_experts", c.get("n_routed_experts", 0)))
        self.mI = c.get("moe_intermediate_size", self.I)

    def moe_layer(self, l):
        if self.E == 0:
            return False
        if self.type == "deepseek_v3":
            return l >= self.c.get("first_k_dense_replace", 0) and l % self.c.get("moe_layer_freq", 1) == 0
        if self.type in ("qwen3_moe", "qwen2_moe"):
            return l not in self.c.get("mlp_only_layers", []) and (l + 1) % self.c.get("decoder_sparse_step", 1) == 0
        return True

    def tensors(self):
        t, H = {}, self.H
        t["model.embed_tokens.weight"] = (self.V, H)
        for l in range(self.L):
            p = f"model.layers.{l}."
            t[p + "input_layernorm.weight"] = (H,)
            t[p + "post_attention_layernorm.weight"] = (H,)
            if self.type == "deepseek_v3":
                c = self.c
                qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
                t[p + "self_attn.q_a_proj.weight"] = (c["q_lora_rank"], H)
                t[p + "self_attn.q_a_layernorm.weight"] = (c["q_lora_rank"],)
                t[p + "self_attn.q_b_proj.weight"] = (self.nh * qk, c["q_lora_rank"])
                t[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
                t[p + "self_attn.kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
                t[p + "self_attn.kv_b_proj.weight"] = (self.nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
                t[p + "self_attn.o_proj.weight"] = (H, self.nh * c["v_head_dim"])
            else:
                for n, rows in (("q", self.nh), ("k", self.nkv), ("v", self.nkv)):
                    t[p + f"self_attn.{n}_proj.weight"] = (rows * self.D, H)
                    if self.type in ("qwen2", "qwen2_moe"):
                        t[p + f"self_attn.{n}_proj.bias"] = (rows * self.D,)
                t[p + "self_attn.o_proj.weight"] = (H, self.nh * self.D)
                if self.type in ("qwen3", "qwen3_moe"):
                    t[p + "self_attn.q_norm.weight"] = (self.D,)
                    t[p + "self_attn.k_norm.weight"] = (self.D,)
            if not self.moe_layer(l):
                for n, s in (("gate", (self.I, H)), ("up", (self.I, H)), ("down", (H, self.I))):
                    t[p + f"mlp.{n}_proj.weight"] = s
                continue
            blk = "block_sparse_moe." if self.type == "mixtral" else "mlp."
            t[p + blk + "gate.weight"] = (self.E, H)
            names = ("w1", "w3", "w2") if self.type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for e in range(self.E):
                t[p + blk + f"experts.{e}.{names[0]}.weight"] = (self.mI, H)
                t[p + blk + f"experts.{e}.{names[1]}.weight"] = (self.mI, H)
                t[p + blk + f"experts.{e}.{names[2]}.weight"] = (H, self.mI)
            if self.type == "deepseek_v3":
                t[p + "mlp.gate.e_score_correction_bias"] = (self.E,)
                sI = self.mI * self.c.get("n_shared_experts", 1)
                for n, s in (("gate", (sI, H)), ("up", (sI, H)), ("down", (H, sI))):
                    t[p + f"mlp.shared_experts.{n}_proj.weight"] = s
            if self.type == "qwen2_moe":
                sI = self.c["shared_expert_intermediate_size"]
                for n, s in (("gate", (sI, H)), ("up", (sI, H)), ("down", (H, sI))):
                    t[p + f"mlp.shared_expert.{n}_proj.weight"] = s
                t[p + "mlp.shared_expert_gate.weight"] = (1, H)
        t["model.norm.weight"] = (H,)
        if not self.tied:
            t["lm_head.weight"] = (self.V, H)
        return t


def rows(a, r, tp):
    n = a.shape[0] // tp
    return a[r * n : (r + 1) * n]


def cols(a, r, tp):
    n = a.shape[-1] // tp
    return a[..., r * n : (r + 1) * n]


def expert_ids(E, ep, r, placement):
    if placement == "round_robin":
        return list(range(r, E, ep))
    base, rem = divmod(E, ep)
    start = r * base + min(r, rem)
    return list(range(start, start + base + (1 if r < rem else 0)))


def vllm_rank(m, hf, tp, r, ep_on, placement, order, unit=1):
    """Engine rank r's params as vLLM's loaders build them. With unit=128 the
    HF arrays are FP8 scale tensors (one entry per 128 x 128 block) and the
    params come out in block space, as the loaders compose scales."""
    out = {}

    def vocab(name):
        vp = -(-m.V // 64) * 64
        full = np.zeros((vp, m.H), np.uint16)
        full[: m.V] = hf[name]
        return rows(full, r, tp)

    out["model.embed_tokens.weight"] = vocab("model.embed_tokens.weight")
    if not m.tied:
        out["lm_head.weight"] = vocab("lm_head.weight")
    out["model.norm.weight"] = hf["model.norm.weight"]
    for l in range(m.L):
        p = f"model.layers.{l}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n]
        a = p + "self_attn."
        if m.type == "deepseek_v3":
            out[a + "fused_qkv_a_proj.weight"] = np.concatenate([hf[a + "q_a_proj.weight"], hf[a + "kv_a_proj_with_mqa.weight"]])
            for n in ("q_a_layernorm.weight", "kv_a_layernorm.weight"):
                out[a + n] = hf[a + n]
            for n in ("q_b_proj.weight", "kv_b_proj.weight"):
                out[a + n] = rows(hf[a + n], r, tp)
            out[a + "o_proj.weight"] = cols(hf[a + "o_proj.weight"], r, tp)
        else:
            for suffix in ("weight", "bias"):
                if a + "q_proj." + suffix not in hf:
                    continue
                q = rows(hf[a + "q_proj." + suffix], r, tp)
                if m.nkv >= tp:
                    k, v = (rows(hf[a + f"{n}_proj." + suffix], r, tp) for n in "kv")
                else:
                    h = r // (tp // m.nkv)
                    k, v = (hf[a + f"{n}_proj." + suffix][h * m.D // unit : (h + 1) * m.D // unit] for n in "kv")
                out[a + "qkv_proj." + suffix] = np.concatenate([q, k, v])
            out[a + "o_proj.weight"] = cols(hf[a + "o_proj.weight"], r, tp)
            for n in ("q_norm.weight", "k_norm.weight"):
                if a + n in hf:
                    out[a + n] = hf[a + n]

        def mlp(src, dst):
            out[dst + "gate_up_proj.weight"] = np.concatenate(
                [rows(hf[src + "gate_proj.weight"], r, tp), rows(hf[src + "up_proj.weight"], r, tp)])
            out[dst + "down_proj.weight"] = cols(hf[src + "down_proj.weight"], r, tp)

        if not m.moe_layer(l):
            mlp(p + "mlp.", p + "mlp.")
            continue
        blk = p + ("block_sparse_moe." if m.type == "mixtral" else "mlp.")
        out[blk + "gate.weight"] = hf[blk + "gate.weight"]
        names = ("w1", "w3", "w2") if m.type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        mtp, mr = (1, 0) if ep_on else (tp, r)
        ids = expert_ids(m.E, tp, r, placement) if ep_on else list(range(m.E))
        w13, w2 = [], []
        for e in ids:
            g = rows(hf[blk + f"experts.{e}.{names[0]}.weight"], mr, mtp)
            u = rows(hf[blk + f"experts.{e}.{names[1]}.weight"], mr, mtp)
            w13.append(np.concatenate([u, g] if order == "w31" else [g, u]))
            w2.append(cols(hf[blk + f"experts.{e}.{names[2]}.weight"], mr, mtp))
        out[blk + "experts.w13_weight"] = np.stack(w13)
        out[blk + "experts.w2_weight"] = np.stack(w2)
        if m.type == "deepseek_v3":
            out[blk + "gate.e_score_correction_bias"] = hf[blk + "gate.e_score_correction_bias"]
            mlp(p + "mlp.shared_experts.", p + "mlp.shared_experts.")
        if m.type == "qwen2_moe":
            mlp(p + "mlp.shared_expert.", p + "mlp.shared_expert.")
            out[p + "mlp.shared_expert_gate.weight"] = hf[p + "mlp.shared_expert_gate.weight"]
    return out


# (model dir, tp, expert_parallel, placement, framework, moe order)
CASES = [
    ("tiny-llama", 1, False, "linear", "vllm", None),
    ("tiny-llama", 4, False, "linear", "vllm", None),
    ("tiny-llama", 8, False, "linear", "vllm", None),  # 2 KV heads on 8 ranks: replicated KV
    ("tiny-qwen2", 2, False, "linear", "vllm", None),
    ("tiny-qwen2", 4, False, "linear", "sglang", None),
    ("tiny-qwen3", 4, False, "linear", "vllm", None),
    ("tiny-qwen3-moe", 2, False, "linear", "vllm", None),
    ("tiny-qwen3-moe", 4, True, "linear", "vllm", None),
    ("tiny-qwen3-moe", 4, True, "round_robin", "vllm", None),
    ("tiny-qwen3-moe", 2, False, "linear", "sglang", "w31"),
    ("tiny-qwen2-moe", 2, False, "linear", "vllm", None),
    ("tiny-qwen2-moe", 4, True, "round_robin", "vllm", None),
    ("tiny-mixtral", 2, False, "linear", "vllm", None),
    ("tiny-mixtral", 4, True, "linear", "vllm", None),
    ("tiny-deepseek-v3", 2, False, "linear", "vllm", None),
    ("tiny-deepseek-v3", 4, True, "linear", "vllm", None),
]


def main():
    binary, src = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(5)
    compared = 0
    with tempfile.TemporaryDirectory() as tmp:
        for model_dir, tp, ep_on, placement, framework, order in CASES:
            cfg = json.load(open(os.path.join(src, "configs", "models", model_dir, "config.json")))
            m = Model(cfg)
            hf = {k: rng.integers(0, 65535, size=s, dtype=np.uint16) for k, s in m.tensors().items()}
            ckpt = os.path.join(tmp, "model.safetensors")
            write_safetensors(ckpt, hf)
            engine = {"framework": framework, "hf_config": cfg, "tp": tp, "expert_parallel": ep_on,
                      "expert_placement": placement, "replicas": 1, "dtype": "BF16"}
            if order:
                engine["moe_order"] = order
            epath = os.path.join(tmp, "engine.json")
            json.dump(engine, open(epath, "w"))
            what = f"{model_dir} {framework} tp={tp} ep={ep_on} {placement} {order or ''}"
            for r in range(tp):
                out = os.path.join(tmp, f"rank{r}.safetensors")
                res = subprocess.run([binary, "materialize", "--checkpoint", ckpt, "--engine", epath,
                                      "--rank", str(r), "--out", out], capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"{what} rank {r}: materialize failed: {res.stderr}")
                    return 1
                got, want = read_safetensors(out), vllm_rank(m, hf, tp, r, ep_on, placement, order)
                if set(got) != set(want):
                    print(f"{what} rank {r}: names differ\n  only ours: {sorted(set(got) - set(want))}\n"
                          f"  only reference: {sorted(set(want) - set(got))}")
                    return 1
                for name, w in want.items():
                    if got[name].shape != w.shape or not np.array_equal(got[name], w):
                        print(f"{what} rank {r}: {name}: shape {got[name].shape} vs reference {w.shape}, "
                              f"bytes {'equal' if got[name].shape == w.shape and np.array_equal(got[name], w) else 'differ'}")
                        return 1
                    compared += 1
    print(f"materialize_check: {len(CASES)} engine setups, {compared} params equal to the vLLM-semantics reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
