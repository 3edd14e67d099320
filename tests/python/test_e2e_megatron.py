"""End to end with real processes: Megatron-Core trainer ranks hold exactly
what Megatron would (built by the independent reference,
megatron_reference.py, from each step's weights: grouped QKV, [gate_r; up_r],
padded vocab, local layer names on their pipeline stage, experts over EP with
expert TP), register them under Megatron's names with
`weightsync.megatron.trainer_layout`, and push 3 steps, each carrying
different bytes in every tensor, into a vLLM replica of tp=2 (direct, in
place) and a load_weights replica (framework "hf": whole HF tensors to a
callback). After every step every engine rank holds exactly
`weightsync materialize` of that step's weights."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import weightsync as ws
import weightsync.megatron as wsm
from helpers import (REPO, cli, collect, load_safetensors, model_config, module_of, run_world,
                     save_safetensors, start_process, write_json)
from megatron_reference import rank_params

sys.path.insert(0, os.path.join(REPO, "examples"))
import engine_worker  # noqa: E402

pytest.importorskip("transformers")

STEPS = 3


def _weights(base: dict, step: int) -> dict:
    """Step `step`'s HF weights: every element's bits XOR-ed with a pattern of
    the step, so that every tensor carries different bytes at every step."""
    out = {}
    for k, t in base.items():
        bits = t.contiguous().view(torch.int16) ^ (0x0101 * step)
        out[k] = bits.view(t.dtype)
    return out


def _trainer(rank: int, world: int, config: dict, sizes: dict, spec: str, base_path: str,
             coordinator: str, engine: str, mode: str) -> list:
    config_path = os.path.join(os.path.dirname(base_path), "config.json")
    layout = wsm.trainer_layout(config_path, spec)
    base = load_safetensors(base_path)
    pub = ws.Publisher(coordinator=coordinator, rank=rank, layout=layout, engine=engine, mode=mode,
                       bucket_bytes=8192)
    params = rank_params(config, sizes, _weights(base, 1), rank)
    model = module_of({k: v.clone() for k, v in params.items()})
    pub.register_module(model)
    results = []
    for step in range(1, STEPS + 1):
        if step > 1:  # the optimizer step: Megatron's params change in place
            new = rank_params(config, sizes, _weights(base, step), rank)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(new[name])
        res = pub.push(step)
        results.append((res.step, sorted(res.committed), list(res.failed)))
    pub.close()
    return results


def _engine(argv: list) -> list:
    return engine_worker.serve(engine_worker.parse_args(argv), STEPS)


CASES = {
    # model, Megatron sizes, plan mode
    "llama-pp2-tp2": ("tiny-llama", {"pp": 2, "tp": 2}, "p2p"),
    "qwen3_moe-pp3-tp2-ep2-etp1": ("tiny-qwen3-moe", {"pp": 3, "tp": 2, "ep": 2, "etp": 1},
                                   "broadcast"),
    # 2 query groups over tp=4: each group's grouped QKV rows on two ranks.
    "llama-tp4-2-groups": ("tiny-llama", {"pp": 1, "tp": 4}, "p2p"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_trainers_into_direct_and_load_weights_replicas(tmp_path, case):
    model, sizes, mode = CASES[case]
    with open(os.path.join(model_config(model), "config.json")) as f:
        config = json.load(f)
    write_json(str(tmp_path / "config.json"), config)
    # A real transformers checkpoint of the model (random weights), as
    # save_pretrained writes it (experts under per-expert keys).
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(15)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)).to(torch.bfloat16)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    base = {}
    for name in sorted(os.listdir(tmp_path / "hf")):
        if name.endswith(".safetensors"):
            base.update(load_safetensors(str(tmp_path / "hf" / name)))
    base_path = save_safetensors(base, str(tmp_path / "base.safetensors"))
    spec = ",".join(f"{k}={v}" for k, v in sizes.items())
    world = sizes["pp"] * sizes["tp"] * sizes.get("dp", 1)
    config_path = str(tmp_path / "config.json")
    vllm = {"framework": "vllm", "hf_config": config_path, "tp": 2, "replicas": 1}
    engine = write_json(str(tmp_path / "engine.json"),
                        [vllm, {**vllm, "framework": "hf", "tp": 1}])
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    ranks = [(0, 0, False), (0, 1, False), (1, 0, True)]  # replica, rank, load_weights
    with ws.Coordinator() as coord:
        engines = []
        for replica, rank, load_weights in ranks:
            argv = ["--coordinator", coord.address, "--engine", engine, "--replica", str(replica),
                    "--rank", str(rank), "--dump", str(dumps)] + \
                (["--load-weights"] if load_weights else [])
            engines.append(start_process(_engine, argv))
        pushes = run_world(_trainer, world, config, sizes, spec, base_path, coord.address, engine,
                           mode, timeout=600)
        outcomes = [collect(p, q, timeout=300) for p, q in engines]
    for rank_pushes in pushes:
        assert [(p[0], p[1], p[2]) for p in rank_pushes] == \
            [(s, [0, 1, 2], []) for s in range(1, STEPS + 1)], rank_pushes
    for out in outcomes:
        assert [(o[0], o[1]) for o in out] == [(s, True) for s in range(1, STEPS + 1)], out
    previous = None
    for step in range(1, STEPS + 1):
        hf = _weights(base, step)
        if previous is not None:
            same = [k for k in hf if torch.equal(hf[k].view(torch.int16),
                                                 previous[k].view(torch.int16))]
            assert not same, f"step {step} carries the bytes of step {step - 1}: {same[:5]}"
        previous = hf
        ckpt = save_safetensors(hf, str(tmp_path / f"step{step}.safetensors"))
        for g, (replica, rank, _) in enumerate(ranks):
            out = str(tmp_path / f"ref-{g}.safetensors")
            cli("materialize", "--checkpoint", ckpt, "--engine", engine, "--rank", str(g),
                "--out", out)
            want = load_safetensors(out)
            got = load_safetensors(str(dumps / f"engine{replica}-rank{rank}-step{step}.safetensors"))
            assert sorted(got) == sorted(want), (step, g)
            for name in want:
                assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), \
                    (step, g, name)
