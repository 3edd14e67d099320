"""GPU peer baseline for `weightsync bench --device cuda`, colocated 1 -> 1:
checkpoint-engine's own colocated update (PyPI `checkpoint-engine`, the
ParameterServer of MoonshotAI's checkpoint-engine), into a torch receiver.

Two processes on GPU 0, as a hybrid engine has them:
  - the trainer holds the job's weights on the GPU and, each step, runs a
    ParameterServer of one rank (its own process group, NCCL): it registers
    the step's weights (`register_checkpoint(named_tensors=...)`, into its
    shared pinned pool), gathers their metadata and calls `update`, which
    moves them bucket by bucket into a GPU buffer shared over CUDA IPC and
    hands each bucket to the worker over ZMQ;
  - the engine runs checkpoint-engine's worker loop
    (`checkpoint_engine.worker.update_weights_from_ipc`) with a receiver that
    copies each HF tensor into its parameters, as the job's layout says
    (narrow, transpose, `copy_`), as checkpoint-engine's tests do with torch.
A step is timed from the registration to the end of the update: a trainer's
weights change every step, so registering them is part of each sync
(`update_s_p50` leaves it out). After the last step the engine compares its
parameters with the checkpoint's, bit for bit.

Only the 1 -> 1 shape: checkpoint-engine runs one ParameterServer rank per
GPU beside its worker, and NCCL refuses two ranks on one GPU. Input: the job
JSON written by `weightsync bench`; output: one JSON object on stdout, or an
error on stderr and a non-zero exit (the bench reports it and goes on).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_ipc_baseline import (  # noqa: E402  (beside this file)
    _CARRIER,
    _ITEMSIZE,
    engine_params,
    free_port,
    open_checkpoint,
    slices,
)

UPDATE_TIMEOUT_S = 300  # one update, worker included (8 GB takes seconds)


def shape_error(job):
    """Why this job is not one checkpoint-engine runs colocated, or None."""
    if job["trainer_world"] != 1 or job["engine_world"] != 1:
        return (f"checkpoint-engine's colocated update is one ParameterServer rank per GPU beside "
                f"its worker: the 1 -> 1 shape only, not {job['trainer_world']} trainer and "
                f"{job['engine_world']} engine ranks")
    return None


def trainer_tensors(job, ckpt, device):
    """{hf key: the whole tensor}: what the single trainer rank holds."""
    out = {}
    for p in job["trainer_pieces"][0]:
        dtype, shape, raw = ckpt[p["hf_key"]]
        if list(p["hf_box"]["lengths"]) != list(shape):
            raise ValueError(f"{p['hf_key']}: trainer rank 0 holds box {p['hf_box']} of "
                             f"{shape}, not the whole tensor")
        full = torch.from_numpy(np.array(raw)).view(_CARRIER[_ITEMSIZE[dtype]]).view(shape)
        out[p["hf_key"]] = full.to(device)
    return out


def load(params, by_key, weights):
    """The receiver: each (hf key, tensor) into the params that take part of it."""
    for key, full in weights:
        for name, s in by_key.get(key, []):
            src = full[slices(s["hf_box"])]
            if s["transpose"]:
                src = src.transpose(-1, -2)
            params[name][slices(s["param_box"])].copy_(src)


def mismatches(job, params, ckpt):
    """Params that differ from the checkpoint's bytes (their names), compared
    as bytes (a float16 carrier may hold NaN patterns)."""
    expected, by_key = engine_params(job, 0, torch.device("cpu"))
    load(expected, by_key, list(trainer_tensors(job, ckpt, torch.device("cpu")).items()))
    return [n for n, t in params.items()
            if not torch.equal(t.cpu().contiguous().view(-1).view(torch.uint8),
                               expected[n].contiguous().view(-1).view(torch.uint8))]


def engine_main(job, conn):
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    params, by_key = engine_params(job, 0, device)
    ctx = zmq.Context()
    while (paths := conn.recv()) is not None:
        try:
            # One GPU, one ParameterServer rank: its one socket.
            (handle,) = paths.values()
            update_weights_from_ipc(ctx, handle, 0, run=lambda w: load(params, by_key, w))
            conn.send("ok")
        except Exception as e:  # noqa: BLE001  (the trainer reports it)
            conn.send(f"engine: {type(e).__name__}: {e}")
            return
    conn.send(mismatches(job, params, open_checkpoint(job["checkpoint"])))


def trainer_main(job, conn, port, steps):
    from checkpoint_engine.ps import ParameterServer

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    named = trainer_tensors(job, open_checkpoint(job["checkpoint"]), device)
    # Its constructor reads RANK from the environment when given rank 0.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    ps = ParameterServer(rank=0, world_size=1, gpu_count=1, master_addr="127.0.0.1",
                         master_port=port)

    def request(socket_paths):  # update() calls it on a thread, as vLLM's RPC would be
        conn.send(dict(socket_paths))
        # Bounded: update() joins this thread even when it failed itself, and
        # the worker then waits on ZMQ for a bucket that never comes.
        if not conn.poll(UPDATE_TIMEOUT_S):
            raise RuntimeError(f"the engine did not finish an update in {UPDATE_TIMEOUT_S} s")
        reply = conn.recv()
        if reply != "ok":
            raise RuntimeError(reply)

    times, update_times = [], []
    for step in range(steps + 1):  # step 0 warms up the pool, NCCL and the IPC mapping
        name = f"step-{step}"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ps.register_checkpoint(name, named_tensors=named, use_shared_memory_pool=True)
        ps.gather_metas(name)
        t1 = time.perf_counter()
        ps.update(name, request)
        t2 = time.perf_counter()
        ps.unregister_checkpoint(name)
        if step > 0:
            times.append(t2 - t0)
            update_times.append(t2 - t1)
    conn.send(None)
    return times, update_times, conn.recv()


def run(job, steps):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    engine = ctx.Process(target=engine_main, args=(job, theirs), daemon=True)
    engine.start()
    finished = False
    try:
        times, update_times, bad = trainer_main(job, ours, free_port(), steps)
        finished = True
    finally:
        # A trainer that failed leaves its engine waiting (on the pipe or on
        # ZMQ): it goes at once.
        if finished:
            engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    if bad:
        raise RuntimeError(f"the engine's params differ from the checkpoint after the last "
                           f"step: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    nbytes = sum(int(np.prod(s["hf_box"]["lengths"])) * _ITEMSIZE[p["dtype"]]
                 for p in job["engine_ranks"][0] for s in p["segments"])
    times, update_times = sorted(times), sorted(update_times)
    p50 = times[len(times) // 2]
    return {
        "method": "checkpoint-engine's colocated update (ParameterServer.register_checkpoint + "
                  "update over CUDA IPC and ZMQ) into a torch receiver",
        "checkpoint_engine": __import__("checkpoint_engine").__version__,
        "steps": len(times),
        "sync_s_p50": p50,
        "sync_s_max": times[-1],
        "update_s_p50": update_times[len(update_times) // 2],
        "engine_rank_bytes": nbytes,
        "engine_rank_gbps": nbytes / p50 / 1e9,
        "bit_exact": True,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="job JSON written by weightsync bench")
    ap.add_argument("--steps", type=int, default=None, help="override the job's step count")
    args = ap.parse_args()
    job = json.load(open(args.job))
    if (why := shape_error(job)) is not None:
        sys.exit(f"peer_checkpoint_engine: {why}")
    try:
        import checkpoint_engine  # noqa: F401
    except ImportError as e:
        sys.exit(f"peer_checkpoint_engine: checkpoint-engine is not importable by {sys.executable} "
                 f"({e}); pip install checkpoint-engine, or on the GPU machine put its wheels in "
                 f".gpu-carry/wheels (tools/gpu/device_checks.sh)")
    if not torch.cuda.is_available():
        sys.exit("peer_checkpoint_engine: torch sees no CUDA device")
    json.dump(run(job, job["steps"] if args.steps is None else args.steps), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
