#!/usr/bin/python3
"""Peer baseline for `weightsync bench`: the same weight sync done the way
common RL frameworks do it, over real processes with torch.distributed (gloo).

Per step, for every Hugging Face tensor in checkpoint order:
  1. the trainer ranks gather the tensor to trainer rank 0 (each distinct
     shard is sent once, by the lowest rank holding it);
  2. trainer rank 0 broadcasts the full tensor to every engine rank;
  3. each engine rank narrows out the boxes its parameters need and copies
     them into its own parameter tensors (transposing where the layout says).

Run with Debian's /usr/bin/python3 (python3-torch, CPU). Input: a job JSON
written by `weightsync bench` (checkpoint path, the trainer ranks' HF boxes,
the engine ranks' parameter segments). Output: one JSON object on stdout with
seconds per step and GB/s.
"""

import argparse
import json
import os
import socket
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# gloo moves raw bytes; these dtypes have gloo kernels and the right item size.
# The values are never interpreted, so bf16 bits ride as float16 safely.
_CARRIER = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8}


def read_safetensors(path):
    """{key: (dtype, shape, np.memmap of raw bytes)} for one file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[key] = (info["dtype"], info["shape"], data[b:e])
    return out


def open_checkpoint(path):
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if not os.path.exists(index):  # one file, as save_pretrained writes small models
            return read_safetensors(os.path.join(path, "model.safetensors"))
        files = sorted({v for v in json.load(open(index))["weight_map"].values()})
        tensors = {}
        for f in files:
            tensors.update(read_safetensors(os.path.join(path, f)))
        return tensors
    return read_safetensors(path)


def as_tensor(dtype, shape, raw):
    size = _ITEMSIZE[dtype]
    arr = np.frombuffer(raw.tobytes(), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).view(_CARRIER[size]).reshape(shape)


def slices(box):
    return tuple(slice(o, o + n) for o, n in zip(box["offsets"], box["lengths"]))


def trainer_shards(job, rank, ckpt):
    """This rank's shards: {hf_key: [(box, tensor)]}, read from the checkpoint."""
    shards = {}
    for piece in job["trainer_pieces"][rank]:
        dtype, shape, raw = ckpt[piece["hf_key"]]
        full = as_tensor(dtype, shape, raw)
        shards.setdefault(piece["hf_key"], []).append(
            (piece["hf_box"], full[slices(piece["hf_box"])].clone()))
    return shards


def senders(job, key):
    """[(owner rank, box)] of the distinct shards of `key`, lowest rank first."""
    seen, out = set(), []
    for r, pieces in enumerate(job["trainer_pieces"]):
        for p in pieces:
            if p["hf_key"] != key:
                continue
            ident = (tuple(p["hf_box"]["offsets"]), tuple(p["hf_box"]["lengths"]))
            if ident not in seen:
                seen.add(ident)
                out.append((r, p["hf_box"]))
    return out


def engine_params(job, erank):
    params, by_key = {}, {}
    for p in job["engine_ranks"][erank]:
        carrier = _CARRIER[_ITEMSIZE[p["dtype"]]]
        params[p["name"]] = torch.zeros(p["shape"], dtype=carrier)
        for s in p["segments"]:
            by_key.setdefault(s["hf_key"], []).append((p["name"], s))
    return params, by_key


def one_step(job, rank, trainers, shards, params, by_key, group):
    for t in job["hf_tensors"]:
        key, shape = t["key"], t["shape"]
        carrier = _CARRIER[_ITEMSIZE[t["dtype"]]]
        full = None
        if rank < trainers:
            owners = senders(job, key)
            if rank == 0:
                full = torch.empty(shape, dtype=carrier)
                for owner, box in owners:
                    if owner == 0:
                        mine = [s for b, s in shards[key] if b == box][0]
                        full[slices(box)].copy_(mine)
                    else:
                        part = torch.empty(box["lengths"], dtype=carrier)
                        dist.recv(part, owner)
                        full[slices(box)].copy_(part)
            else:
                for owner, box in owners:
                    if owner == rank:
                        dist.send([s for b, s in shards[key] if b == box][0].contiguous(), 0)
        else:
            full = torch.empty(shape, dtype=carrier)
        if rank == 0 or rank >= trainers:
            dist.broadcast(full, 0, group=group)
        if rank >= trainers:
            for name, s in by_key.get(key, []):
                src = full[slices(s["hf_box"])]
                if s["transpose"]:
                    src = src.transpose(-1, -2)
                params[name][slices(s["param_box"])].copy_(src)


def worker(rank, job, port, result_path):
    trainers, engines = job["trainer_world"], job["engine_world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=trainers + engines)
    group = dist.new_group([0] + list(range(trainers, trainers + engines)))
    ckpt = open_checkpoint(job["checkpoint"])
    shards = trainer_shards(job, rank, ckpt) if rank < trainers else {}
    params, by_key = engine_params(job, rank - trainers) if rank >= trainers else ({}, {})
    times = []
    for step in range(job["steps"] + 1):  # step 0 warms up connections and allocators
        dist.barrier()
        t0 = time.perf_counter()
        one_step(job, rank, trainers, shards, params, by_key, group)
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - t0)
    if rank == trainers:
        nbytes = [sum(int(np.prod(s["hf_box"]["lengths"])) * _ITEMSIZE[p["dtype"]]
                      for p in job["engine_ranks"][e] for s in p["segments"])
                  for e in range(engines)]
        with open(result_path, "w") as f:
            json.dump({"times": times, "engine_rank_bytes": nbytes}, f)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="job JSON written by weightsync bench")
    ap.add_argument("--steps", type=int, default=None, help="override the job's step count")
    args = ap.parse_args()
    job = json.load(open(args.job))
    if args.steps is not None:
        job["steps"] = args.steps
    result_path = args.job + ".peer_result.json"
    world = job["trainer_world"] + job["engine_world"]
    mp.spawn(worker, args=(job, free_port(), result_path), nprocs=world, join=True)
    res = json.load(open(result_path))
    times = sorted(res["times"])
    per_rank = max(res["engine_rank_bytes"])
    p50 = times[len(times) // 2]
    out = {
        "method": "gloo gather to trainer rank 0, broadcast tensor by tensor, narrow+copy",
        "steps": len(times),
        "sync_s_p50": p50,
        "sync_s_max": times[-1],
        "engine_rank_bytes": per_rank,
        "engine_rank_gbps": per_rank / p50 / 1e9,
        "total_gbps": sum(res["engine_rank_bytes"]) / p50 / 1e9,
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
