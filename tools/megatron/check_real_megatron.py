"""Real Megatron-Core (CPU, gloo) against weightsync's Megatron layout when tp
> num_query_groups: each rank's linear_qkv (and bias, q/k norms) as
`weightsync shard` cuts them is loaded into a real GPTModel at that tp; the
model's logits must equal the HF model's (fp32), its sharded_state_dict must
place the rank's linear_qkv rows where weightsync's layout does, and the
concatenation of the tp ranks' qkv must equal the tp=1 model's bit for bit.

Not part of CI (it needs megatron-core, and on a CPU two stand-ins: an
explicit causal mask and no CUDA device/RNG calls). To run it:

    pip install --no-deps --target /tmp/mcore megatron-core==0.16.1
    PYTHONPATH=/tmp/mcore WEIGHTSYNC_CLI=build/bin/weightsync \
        .venv/bin/python tools/megatron/check_real_megatron.py

Measured (2 cores, megatron-core 0.16.1, whose tp > num_query_groups path
is 0.19's): llama 1 group tp=2 and tp=4, qwen3 2 groups tp=4, qwen2 (bias)
1 group tp=2: max |Megatron - HF| logits 8.9e-8 .. 1.2e-7.
"""
import json, os, subprocess, sys, tempfile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CLI = os.environ["WEIGHTSYNC_CLI"]

def hf_model(family, heads, groups, hd, path):
    import transformers
    c = dict(model_type=family, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=heads, num_key_value_heads=groups, head_dim=hd, vocab_size=100,
             max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, torch_dtype="float32")
    if family == "qwen2":
        c.pop("head_dim")
        c["hidden_size"] = heads * hd
    torch.manual_seed(7)
    cfg = transformers.AutoConfig.for_model(**c)
    m = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # no zero/one params: norms and biases random too
        for n, p in m.named_parameters():
            if "norm" in n or "bias" in n:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in n else 0.0))
    m.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        return m, json.load(f)

def rename(name):  # TE layer spec names -> local layer spec names
    return (name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
                .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))

def worker(rank, world, store, cfg, shard_dir, tokens, out_q):
    try:
        _worker(rank, world, store, cfg, shard_dir, tokens, out_q)
    except BaseException:
        import traceback
        import pickle
        out_q.put(pickle.dumps((rank, traceback.format_exc(), None, None)))
        raise

def _worker(rank, world, store, cfg, shard_dir, tokens, out_q):
    # CPU only: Megatron's rotary embedding moves its frequencies to
    # torch.cuda.current_device(); point that at the CPU.
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from safetensors.torch import load_file
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    import contextlib
    from megatron.core import tensor_parallel
    # No CUDA RNG states on a CPU (dropout is 0 anyway).
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    qwen3 = cfg["model_type"] == "qwen3"
    tc = TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=cfg["model_type"] == "qwen2", qk_layernorm=qwen3,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32,
        tensor_model_parallel_size=world, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(qk_layernorm=qwen3, normalization="RMSNorm")
    vocab = -(-cfg["vocab_size"] // (128 * world)) * (128 * world)
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=64, position_embedding_type="rope",
                     rotary_base=int(cfg["rope_theta"]) if "rope_theta" in cfg else 10000,
                     share_embeddings_and_output_weights=False, parallel_output=False)
    shard = load_file(os.path.join(shard_dir, f"rank{rank}.safetensors"))
    params = dict(model.named_parameters())
    got = {rename(k): v for k, v in shard.items()}
    assert sorted(got) == sorted(params), (sorted(set(got) ^ set(params)))
    with torch.no_grad():
        for k, v in got.items():
            assert params[k].shape == v.shape, (k, params[k].shape, v.shape)
            params[k].copy_(v)
    model.eval()
    with torch.no_grad():
        ids = tokens.unsqueeze(0)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        sq = ids.shape[1]  # causal, True = masked (Megatron's default mask is built on CUDA)
        mask = torch.triu(torch.ones(sq, sq), diagonal=1).bool()[None, None]
        logits = model(ids, pos, attention_mask=mask)
    # Where Megatron's own checkpointing puts this rank's qkv rows.
    sd = model.sharded_state_dict()
    where = {}
    for k in ("decoder.layers.0.self_attention.linear_qkv.weight",
              "decoder.layers.0.self_attention.linear_qkv.bias"):
        if k in sd:
            t = sd[k]
            n = len(t.local_shape)  # without the leading layer axis Megatron prepends
            where[k] = (tuple(t.global_offset[-n:]), tuple(t.local_shape),
                        tuple(t.global_shape[-n:]), tuple(t.axis_fragmentations[-n:]))
    qkv = {k: v for k, v in params.items() if "linear_qkv.weight" in k or "linear_qkv.bias" in k
           or "layernorm" in k}
    import pickle  # by value: no shared memory that dies with this process
    out_q.put(pickle.dumps((rank, logits[0, :, :cfg["vocab_size"]].clone(), where,
                            {k: v.detach().clone() for k, v in qkv.items()})))
    dist.barrier()
    dist.destroy_process_group()

def run_megatron(cfg, shard_dir, tokens, tp, tmp):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tmp, f"store{tp}")
    procs = [ctx.Process(target=worker, args=(r, tp, store, cfg, shard_dir, tokens, q))
             for r in range(tp)]
    for p in procs: p.start()
    import pickle
    res = sorted([pickle.loads(q.get(timeout=300)) for _ in range(tp)], key=lambda x: x[0])
    for r in res:
        assert not isinstance(r[1], str), r[1]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return res

def shard(ckpt, tp, tmp):
    d = os.path.join(tmp, f"tp{tp}")
    os.makedirs(d, exist_ok=True)
    layout = os.path.join(d, "layout.json")
    subprocess.run([CLI, "trainer-layout", "--style", "megatron", "--hf-config",
                    os.path.join(ckpt, "config.json"), "--mesh", f"tp={tp}", "--dtype", "F32",
                    "--out", layout], check=True)
    for r in range(tp):
        subprocess.run([CLI, "shard", "--checkpoint", ckpt, "--trainer", layout, "--rank", str(r),
                        "--out", os.path.join(d, f"rank{r}.safetensors")], check=True,
                       capture_output=True)
    with open(layout) as f:
        return d, json.load(f)

def check(family, heads, groups, hd, tps):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "hf")
        hf, cfg = hf_model(family, heads, groups, hd, ckpt)
        tokens = torch.randint(0, cfg["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = hf(tokens.unsqueeze(0)).logits[0]
        base = None
        for tp in tps:
            d, layout = shard(ckpt, tp, tmp)
            res = run_megatron(cfg, d, tokens, tp, tmp)
            err = (res[0][1] - want).abs().max().item()
            print(f"{family} heads={heads} groups={groups} hd={hd} tp={tp}: "
                  f"max |megatron - hf| = {err:.2e}")
            assert err < 1e-4, err
            for r, logits, where, qkv in res:
                assert torch.equal(logits, res[0][1])
                rows = (heads + 2 * groups) * hd
                for k, (off, local, glob, frag) in where.items():
                    print(f"  rank {r} {k.split('.')[-1]}: megatron global_offset={off} "
                          f"local_shape={local} global_shape={glob} fragments={frag}")
                    assert glob[0] == rows and local[0] == rows // tp and off[0] == r * rows // tp
                # q/k norms whole on every rank
                for k, v in qkv.items():
                    if "q_layernorm" in k or "k_layernorm" in k:
                        assert v.shape == (hd,), (k, v.shape)
            cat = {k: torch.cat([x[3][k] for x in res]) for k in res[0][3] if "linear_qkv" in k}
            if base is None:
                base = cat
            else:
                for k in cat:
                    assert torch.equal(cat[k], base[k]), k
        print(f"  OK {family} {tps}")

if __name__ == "__main__":
    check("llama", 4, 1, 8, [1, 2, 4])   # 1 group at tp=2 and tp=4 (blocks cut heads)
    check("qwen3", 8, 2, 8, [1, 2, 4])   # q/k norms, 2 groups at tp=4
    check("qwen2", 4, 1, 8, [1, 2])      # QKV bias, 1 group at tp=2
    print("ALL OK")
