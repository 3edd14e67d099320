#!/usr/bin/env python3
"""Independent check of FP8 engines: `weightsync materialize` against numpy
with ml_dtypes' float8_e4m3fn.

The reference quantizer follows DESIGN.md "FP8 engines" (DeepGEMM's
per_block_cast_to_fp8 as vLLM uses it): per 128 x 128 block of an HF tensor
(edge blocks smaller), a = max(max|x|, 1e-4), s = a / 448 in FP32 (UE8M0: the
least power of two >= s), q = float8_e4m3fn(x * (1 / s)) in FP32, saturated
at +-448. Engine params are composed from the quantized HF tensors the way
vLLM's loaders compose FP8 checkpoints: weights in element space, scales in
block space (materialize_check.vllm_rank with unit=128).

1. Quantizer: framework "hf" engines hold every HF tensor whole, so each
   quantized key's bytes and scales are the C++ quantizer's output for that
   tensor; tensors are filled with random and adversarial blocks (zeros,
   subnormals, +-448, huge values, one outlier, amax at the 1e-4 floor).
2. Layouts: tiny FP8 llama, qwen3_moe and deepseek_v3 engines, tp 1/2/4,
   with and without expert parallel, FP32 and UE8M0 scales: every param,
   every FP8 weight and every scale equals the reference.

usage: fp8_check.py WEIGHTSYNC_BINARY SOURCE_DIR
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    import ml_dtypes
    import numpy as np
except ImportError as e:
    print(f"SKIPPED: needs numpy and ml_dtypes (pip install ml_dtypes): {e}")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from materialize_check import Model, vllm_rank, write_safetensors  # noqa: E402

NP_DTYPES = {"BF16": np.uint16, "F8_E4M3": np.uint8, "F32": np.float32}


def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], np.frombuffer(data[8 + n + b : 8 + n + e],
                                                  dtype=NP_DTYPES[info["dtype"]]).reshape(info["shape"]))
    return out


def quantized_key(key, shape):
    """The HF tensors FP8 checkpoints store in FP8 (DESIGN.md)."""
    if len(shape) != 2:
        return False
    if key.endswith(("_proj.weight", ".kv_a_proj_with_mqa.weight")):
        return True
    return ".experts." in key and key.endswith((".w1.weight", ".w2.weight", ".w3.weight"))


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def quantize(u16, ue8m0):
    """(FP8 bytes as uint8, F32 scales) of a BF16 tensor given as uint16."""
    x = bf16_to_f32(u16)
    rows, cols = x.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = np.zeros((br * 128, bc * 128), np.float32)
    padded[:rows, :cols] = x
    amax = np.abs(padded).reshape(br, 128, bc, 128).max(axis=(1, 3))
    s = np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)
    if ue8m0:
        mant, exp = np.frexp(s)
        s = np.where(mant == 0.5, s, np.ldexp(np.float32(1.0), exp)).astype(np.float32)
    inv = (np.float32(1.0) / s).astype(np.float32)
    y = x * np.repeat(np.repeat(inv, 128, axis=0), 128, axis=1)[:rows, :cols]
    y = np.clip(y, np.float32(-448.0), np.float32(448.0))
    q = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert not np.any((q & 0x7F) == 0x7F), "reference made a NaN"
    return q, s.astype(np.float32)


def random_bf16(rng, shape, std=0.02):
    return (rng.normal(0, std, size=shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16(values):
    """float32 values (exact in BF16) to BF16 bits."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def adversarial(rng, shape):
    """A tensor whose 128 x 128 blocks cycle through the hard cases."""
    rows, cols = shape
    out = random_bf16(rng, shape)
    kinds = 7
    for i in range(-(-rows // 128)):
        for j in range(-(-cols // 128)):
            r0, c0 = i * 128, j * 128
            h, w = min(128, rows - r0), min(128, cols - c0)
            kind = (i * 3 + j) % kinds
            if kind == 0:  # zeros (the 1e-4 floor), with a negative zero
                blk = np.zeros((h, w), np.uint16)
                blk[0, 0] = 0x8000
            elif kind == 1:  # BF16 subnormals and tiny normals
                blk = rng.integers(1, 0x0100, size=(h, w), dtype=np.uint16) | \
                      (rng.integers(0, 2, size=(h, w), dtype=np.uint16) << 15)
            elif kind == 2:  # +-448 and values near it
                v = rng.uniform(-448, 448, size=(h, w)).astype(np.float32)
                v.flat[:: 3] = 448.0
                v.flat[1 :: 7] = -448.0
                blk = bf16(v)
            elif kind == 3:  # huge values: the scale far above 1
                v = rng.uniform(-1, 1, size=(h, w)).astype(np.float32) * np.float32(1e30)
                v.flat[0] = np.float32(3.0e38)
                blk = bf16(v)
            elif kind == 4:  # one outlier: the rest flush toward subnormal E4M3
                v = rng.uniform(-0.05, 0.05, size=(h, w)).astype(np.float32)
                v[h // 2, w // 2] = 1000.0
                blk = bf16(v)
            elif kind == 5:  # amax near the floor
                blk = bf16(rng.uniform(-1.5e-4, 1.5e-4, size=(h, w)).astype(np.float32))
            else:  # wide dynamic range
                blk = bf16((rng.normal(0, 1, size=(h, w)) * 2.0 ** rng.integers(-20, 20, size=(h, w)))
                           .astype(np.float32))
            out[r0 : r0 + h, c0 : c0 + w] = blk
    return out


def reference_engine(m, hf, tp, r, ep, placement, ue8m0):
    """Engine rank r's params: {name: (dtype, array)}."""
    qkeys = {k for k, a in hf.items() if quantized_key(k, a.shape)}
    qs = {k: quantize(hf[k], ue8m0) for k in qkeys}
    plain = vllm_rank(m, hf, tp, r, ep, placement, None)
    fp8 = vllm_rank(m, {k: (qs[k][0] if k in qs else a) for k, a in hf.items()}, tp, r, ep, placement, None)
    scales = vllm_rank(m, {k: (qs[k][1] if k in qs else a) for k, a in hf.items()}, tp, r, ep, placement,
                       None, unit=128)
    out = {}
    for name, a in plain.items():
        if fp8[name].dtype == np.uint8:
            out[name] = ("F8_E4M3", fp8[name])
            out[name + "_scale_inv"] = ("F32", scales[name])
        else:
            out[name] = ("BF16", a)
    return out


def compare(what, got, want):
    if set(got) != set(want):
        return (f"{what}: names differ\n  only ours: {sorted(set(got) - set(want))}\n"
                f"  only reference: {sorted(set(want) - set(got))}")
    for name, (dt, w) in want.items():
        gdt, g = got[name]
        if gdt != dt or g.shape != w.shape:
            return f"{what}: {name}: {gdt} {list(g.shape)} vs reference {dt} {list(w.shape)}"
        if dt == "F32":
            bad = np.flatnonzero(g.view(np.uint32) != w.view(np.uint32))
        else:
            bad = np.flatnonzero(g != w)
        if bad.size:
            i = bad[0]
            return (f"{what}: {name}: {bad.size} of {w.size} elements differ, first at flat {i}: "
                    f"{g.flat[i]!r} vs reference {w.flat[i]!r}")
    return None


def materialize(binary, ckpt, engine, rank, tmp):
    epath = os.path.join(tmp, "engine.json")
    json.dump(engine, open(epath, "w"))
    out = os.path.join(tmp, f"rank{rank}.safetensors")
    res = subprocess.run([binary, "materialize", "--checkpoint", ckpt, "--engine", epath, "--rank", str(rank),
                          "--out", out], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"materialize failed: {res.stderr}")
    return read_safetensors(out)


# (model dir, tp, expert_parallel, scale)
LAYOUT_CASES = [
    ("tiny-fp8-llama", 1, False, "fp32"),
    ("tiny-fp8-llama", 2, False, "fp32"),
    ("tiny-fp8-llama", 4, False, "ue8m0"),  # 2 KV heads on 4 ranks: replicated KV blocks
    ("tiny-fp8-qwen3-moe", 1, False, "fp32"),
    ("tiny-fp8-qwen3-moe", 2, False, "ue8m0"),
    ("tiny-fp8-qwen3-moe", 4, False, "fp32"),
    ("tiny-fp8-qwen3-moe", 2, True, "fp32"),
    ("tiny-fp8-qwen3-moe", 4, True, "fp32"),
    ("tiny-fp8-deepseek-v3", 1, False, "fp32"),
    ("tiny-fp8-deepseek-v3", 2, False, "fp32"),
    ("tiny-fp8-deepseek-v3", 4, False, "ue8m0"),
    ("tiny-fp8-deepseek-v3", 4, True, "fp32"),
]


def main():
    binary, src = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(13)
    blocks = params = 0
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model.safetensors")
        # 1. The quantizer, tensor by tensor (framework "hf": whole tensors).
        for model_dir in ("tiny-fp8-llama", "tiny-fp8-deepseek-v3"):
            cfg = json.load(open(os.path.join(src, "configs", "models", model_dir, "config.json")))
            m = Model(cfg)
            hf = {k: adversarial(rng, s) if len(s) == 2 else random_bf16(rng, s) for k, s in m.tensors().items()}
            write_safetensors(ckpt, hf)
            for scale in ("fp32", "ue8m0"):
                engine = {"framework": "hf", "hf_config": cfg, "tp": 1, "dtype": "BF16",
                          "quantization": {"method": "fp8", "weight_block_size": [128, 128], "scale": scale}}
                got = materialize(binary, ckpt, engine, 0, tmp)
                want = {}
                for k, a in hf.items():
                    if quantized_key(k, a.shape):
                        q, s = quantize(a, scale == "ue8m0")
                        want[k], want[k + "_scale_inv"] = ("F8_E4M3", q), ("F32", s)
                        blocks += s.size
                    else:
                        want[k] = ("BF16", a)
                err = compare(f"{model_dir} hf {scale} (adversarial blocks)", got, want)
                if err:
                    print(err)
                    return 1
        # 2. Engine layouts.
        for model_dir, tp, ep, scale in LAYOUT_CASES:
            cfg = json.load(open(os.path.join(src, "configs", "models", model_dir, "config.json")))
            m = Model(cfg)
            hf = {k: random_bf16(rng, s) for k, s in m.tensors().items()}
            write_safetensors(ckpt, hf)
            engine = {"framework": "vllm", "hf_config": cfg, "tp": tp, "expert_parallel": ep,
                      "expert_placement": "linear", "replicas": 1, "dtype": "BF16",
                      "quantization": {"method": "fp8", "weight_block_size": [128, 128], "scale": scale}}
            for r in range(tp):
                what = f"{model_dir} tp={tp} ep={ep} {scale} rank {r}"
                got = materialize(binary, ckpt, engine, r, tmp)
                want = reference_engine(m, hf, tp, r, ep, "linear", scale == "ue8m0")
                if not any(dt == "F8_E4M3" for dt, _ in want.values()):
                    print(f"{what}: the reference has no FP8 param")
                    return 1
                err = compare(what, got, want)
                if err:
                    print(err)
                    return 1
                params += len(want)
    print(f"fp8_check: {blocks} adversarial blocks and {len(LAYOUT_CASES)} FP8 engine setups "
          f"({params} params and scales) equal to the numpy/ml_dtypes reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
