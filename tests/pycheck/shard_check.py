#!/usr/bin/env python3
"""Independent check of `weightsync shard` against PyTorch's sharding semantics.

Generates random checkpoints and trainer layouts (uneven and empty shards,
nested and interleaved shards, fused keys, tail padding, replicated axes),
runs the real `weightsync shard` binary for every rank and compares every byte
with tensors cut by torch (torch.cat / F.pad / chunking as DTensor's Shard
does it). Written from DESIGN.md's rules, sharing no code with the C++ side.

usage: shard_check.py WEIGHTSYNC_BINARY [--cases N] [--seed S]
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:  # CTest reports exit code 77 as "skipped", with this reason
    print(f"SKIPPED: needs numpy and torch (Debian: python3-numpy python3-torch): {e}")
    sys.exit(77)

DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I64": np.int64, "U8": np.uint8}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        arr = np.frombuffer(data[base + b : base + e], dtype=DTYPES[info["dtype"]])
        out[name] = (info["dtype"], arr.reshape(info["shape"]))
    return out


def torch_shard(t, dim, w, r, interleave):
    """The rank-r part of `t` along `dim` over `w` ranks (PyTorch Shard semantics)."""
    n = t.shape[dim]
    if interleave == 1:
        chunk = -(-n // w) if n else 0
        lo, hi = min(n, r * chunk), min(n, (r + 1) * chunk)
        return t.narrow(dim, lo, hi - lo)
    runs = torch.chunk(t, w * interleave, dim=dim) if n else []
    return torch.cat([runs[j * w + r] for j in range(interleave)], dim=dim)


def random_case(rng, case):
    axes = ["ep", "fsdp", "dp"][: rng.randint(1, 3)]
    shape = [rng.randint(1, 5) for _ in axes]
    params, tensors = [], {}
    for p in range(rng.randint(1, 4)):
        rank = rng.randint(1, 3)
        dtype = rng.choice(list(DTYPES))
        nkeys = rng.choice([1, 1, 2, 3])
        fused = rng.randrange(rank) if nkeys > 1 else None
        key_shape = [rng.randint(1, 7) for _ in range(rank)]
        origin = list(key_shape)
        if fused is not None:
            origin[fused] *= nkeys
        glob = list(origin)
        if rng.random() < 0.4:  # tail padding on one dim
            glob[rng.randrange(rank)] += rng.randint(1, 4)
        shards, used = [], set()
        for _ in range(rng.randint(0, len(axes))):
            free = [a for a in range(len(axes)) if a not in used]
            if not free:
                break
            a = rng.choice(free)
            used.add(a)
            dim = rng.randrange(rank)
            shards.append({"dim": dim, "axis": axes[a]})
        # Interleave only where every rank cuts the same extent and it divides.
        extents = list(glob)
        uniform = [True] * rank
        for s in shards:
            w = shape[axes.index(s["axis"])]
            d = s["dim"]
            n = extents[d]
            for f in (3, 2):
                if uniform[d] and n and n % (w * f) == 0 and rng.random() < 0.5:
                    s["interleave"] = f
                    break
            if n % w:
                uniform[d] = False
            extents[d] = -(-n // w) if n else 0
        keys = [f"c{case}.p{p}.k{k}" for k in range(nkeys)]
        for k in keys:
            arr = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 250, size=key_shape).astype(DTYPES[dtype])
            tensors[k] = (dtype, arr)
        params.append({"name": f"c{case}.param{p}", "hf_keys": keys, "fused_dim": fused,
                       "global_shape": glob, "origin_shape": origin, "dtype": dtype, "shards": shards})
    return {"mesh": {"axes": axes, "shape": shape}, "params": params}, tensors


def expected_local(layout, tensors, rank):
    axes, shape = layout["mesh"]["axes"], layout["mesh"]["shape"]
    coords = np.unravel_index(rank, shape) if shape else ()
    out = {}
    for p in layout["params"]:
        parts = [torch.from_numpy(tensors[k][1].astype(np.float64)) for k in p["hf_keys"]]
        t = torch.cat(parts, dim=p["fused_dim"]) if p["fused_dim"] is not None else parts[0]
        pad = []
        for d in reversed(range(t.dim())):
            pad += [0, p["global_shape"][d] - t.shape[d]]
        t = torch.nn.functional.pad(t, pad)
        for s in p["shards"]:
            a = axes.index(s["axis"])
            t = torch_shard(t, s["dim"], shape[a], int(coords[a]), s.get("interleave", 1))
        out[p["name"]] = t.contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    checked = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(args.cases):
            layout, tensors = random_case(rng, case)
            ckpt, lay = os.path.join(tmp, "ckpt.safetensors"), os.path.join(tmp, "layout.json")
            write_safetensors(ckpt, tensors)
            with open(lay, "w") as f:
                json.dump(layout, f)
            world = int(np.prod(layout["mesh"]["shape"]))
            for rank in range(world):
                out = os.path.join(tmp, f"rank{rank}.safetensors")
                r = subprocess.run([args.binary, "shard", "--checkpoint", ckpt, "--trainer", lay,
                                    "--rank", str(rank), "--out", out], capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"case {case} rank {rank}: weightsync shard failed: {r.stderr}\n{json.dumps(layout)}")
                    return 1
                got = read_safetensors(out)
                for name, want in expected_local(layout, tensors, rank).items():
                    dtype, arr = got[name]
                    if list(arr.shape) != list(want.shape) or not np.array_equal(arr.astype(np.float64), want.numpy()):
                        print(f"case {case} rank {rank} param {name}: got shape {list(arr.shape)}, "
                              f"want {list(want.shape)}\nlayout: {json.dumps(layout)}")
                        return 1
                    checked += 1
    print(f"shard_check: {args.cases} random layouts, {checked} local tensors match PyTorch semantics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
