"""GPU peer baseline for `weightsync bench --device cuda`: the same weight
sync done PyTorch's way, as vLLM's IPC weight-transfer backend and the
colocated (hybrid-engine) RL frameworks do it, over real processes.

Trainer rank 0 allocates two packed bucket buffers (double buffering) in GPU
memory and shares them with every rank over CUDA IPC
(torch.multiprocessing's CUDA tensor sharing). Per bucket of HF tensors (in
checkpoint order, up to --bucket-bytes each):
  1. the trainer ranks copy their shards of the bucket's tensors into the
     packed buffer, tensor by tensor (each distinct shard once, by the lowest
     rank holding it);
  2. a barrier (gloo) hands the bucket over;
  3. each engine rank copies the boxes its parameters need out of the
     bucket, tensor by tensor (narrow, transpose where the layout says, copy_).
A barrier per bucket also tells the trainers when a buffer is free again.

Every rank's tensors are in GPU memory: rank r on GPU r modulo the GPUs, as
`weightsync bench --device cuda` places them. Run with a Python that has a
CUDA build of torch ($WEIGHTSYNC_PYTHON, or the repository's .venv). Input:
the job JSON written by `weightsync bench`; output: one JSON object on stdout.
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
from torch.multiprocessing.reductions import reduce_tensor

# Raw bytes ride in dtypes of the right item size; values are never read.
_CARRIER = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8}


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def open_checkpoint(path):
    if not os.path.isdir(path):
        return read_safetensors(path)
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        return read_safetensors(os.path.join(path, "model.safetensors"))  # one file
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(read_safetensors(os.path.join(path, f)))
    return out


def slices(box):
    return tuple(slice(o, o + n) for o, n in zip(box["offsets"], box["lengths"]))


def buckets_of(job, bucket_bytes):
    """[[(key, dtype, shape, offset)]]: HF tensors packed back to back."""
    out, cur, used = [], [], 0
    for t in job["hf_tensors"]:
        nbytes = int(np.prod(t["shape"])) * _ITEMSIZE[t["dtype"]]
        if cur and used + nbytes > bucket_bytes:
            out.append(cur)
            cur, used = [], 0
        cur.append((t["key"], t["dtype"], t["shape"], used))
        used += (nbytes + 255) // 256 * 256
    if cur:
        out.append(cur)
    return out


def view_of(buf, dtype, shape, offset):
    n = int(np.prod(shape)) * _ITEMSIZE[dtype]
    return buf[offset:offset + n].view(_CARRIER[_ITEMSIZE[dtype]]).view(shape)


def trainer_shards(job, rank, ckpt, device):
    """{key: [(box, tensor on the GPU)]} of the distinct shards this rank sends."""
    owner = {}
    for r, pieces in enumerate(job["trainer_pieces"]):
        for p in pieces:
            ident = (p["hf_key"], tuple(p["hf_box"]["offsets"]), tuple(p["hf_box"]["lengths"]))
            owner.setdefault(ident, r)
    shards = {}
    for p in job["trainer_pieces"][rank]:
        ident = (p["hf_key"], tuple(p["hf_box"]["offsets"]), tuple(p["hf_box"]["lengths"]))
        if owner[ident] != rank:
            continue
        dtype, shape, raw = ckpt[p["hf_key"]]
        full = torch.from_numpy(np.array(raw)).view(_CARRIER[_ITEMSIZE[dtype]]).view(shape)
        shards.setdefault(p["hf_key"], []).append(
            (p["hf_box"], full[slices(p["hf_box"])].contiguous().to(device)))
    return shards


def engine_params(job, erank, device):
    params, by_key = {}, {}
    for p in job["engine_ranks"][erank]:
        params[p["name"]] = torch.zeros(p["shape"], dtype=_CARRIER[_ITEMSIZE[p["dtype"]]],
                                        device=device)
        for s in p["segments"]:
            by_key.setdefault(s["hf_key"], []).append((p["name"], s))
    return params, by_key


def one_step(buckets, bufs, rank, trainers, shards, params, by_key):
    for b, bucket in enumerate(buckets):
        buf = bufs[b % 2]
        if rank < trainers:
            for key, dtype, shape, offset in bucket:
                full = view_of(buf, dtype, shape, offset)
                for box, shard in shards.get(key, []):
                    full[slices(box)].copy_(shard)
            torch.cuda.synchronize()
        dist.barrier()  # the bucket is packed; engines read it while trainers pack the next
        if rank >= trainers:
            for key, dtype, shape, offset in bucket:
                full = view_of(buf, dtype, shape, offset)
                for name, s in by_key.get(key, []):
                    src = full[slices(s["hf_box"])]
                    if s["transpose"]:
                        src = src.transpose(-1, -2)
                    params[name][slices(s["param_box"])].copy_(src)
            torch.cuda.synchronize()
    dist.barrier()


def worker(rank, job, port, result_path, bucket_bytes):
    trainers, engines = job["trainer_world"], job["engine_world"]
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=trainers + engines)
    buckets = buckets_of(job, bucket_bytes)
    size = max(sum((int(np.prod(s)) * _ITEMSIZE[d] + 255) // 256 * 256 for _, d, s, _ in b)
               for b in buckets)
    handles = [None]
    if rank == 0:
        own = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        handles = [[reduce_tensor(t) for t in own]]
    dist.broadcast_object_list(handles, src=0)
    bufs = own if rank == 0 else [fn(*args) for fn, args in handles[0]]
    ckpt = open_checkpoint(job["checkpoint"])
    shards = trainer_shards(job, rank, ckpt, device) if rank < trainers else {}
    params, by_key = engine_params(job, rank - trainers, device) if rank >= trainers else ({}, {})
    times = []
    for step in range(job["steps"] + 1):  # step 0 warms up allocators and IPC mappings
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        one_step(buckets, bufs, rank, trainers, shards, params, by_key)
        if step > 0:
            times.append(time.perf_counter() - t0)
    if rank == trainers:
        nbytes = [sum(int(np.prod(s["hf_box"]["lengths"])) * _ITEMSIZE[p["dtype"]]
                      for p in job["engine_ranks"][e] for s in p["segments"])
                  for e in range(engines)]
        with open(result_path, "w") as f:
            json.dump({"times": times, "engine_rank_bytes": nbytes, "buckets": len(buckets)}, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="job JSON written by weightsync bench")
    ap.add_argument("--steps", type=int, default=None, help="override the job's step count")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peer_ipc_baseline: torch sees no CUDA device")
    job = json.load(open(args.job))
    if args.steps is not None:
        job["steps"] = args.steps
    result_path = args.job + ".peer_ipc_result.json"
    world = job["trainer_world"] + job["engine_world"]
    mp.spawn(worker, args=(job, free_port(), result_path, args.bucket_bytes), nprocs=world,
             join=True)
    res = json.load(open(result_path))
    times = sorted(res["times"])
    per_rank = max(res["engine_rank_bytes"])
    p50 = times[len(times) // 2]
    json.dump({
        "method": "per-tensor copy_ into a double-buffered packed bucket shared over CUDA IPC, "
                  "per-tensor copy_ out into the params (vLLM's IPC weight transfer)",
        "bucket_bytes": args.bucket_bytes,
        "buckets": res["buckets"],
        "steps": len(times),
        "sync_s_p50": p50,
        "sync_s_max": times[-1],
        "engine_rank_bytes": per_rank,
        "engine_rank_gbps": per_rank / p50 / 1e9,
        "total_gbps": sum(res["engine_rank_bytes"]) / p50 / 1e9,
    }, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
