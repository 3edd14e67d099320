"""vLLM 0.32 builds, from a tiny FP8 config.json, exactly the FP8 params (and
scale params) weightsync's layout of framework "vllm" has (issue 54): the
model is constructed on the meta device in one child process (fp8_models.py,
no kernels, no weights, about 40 s for all the models), then compared
with weightsync.engine_params at tp=1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import weightsync as ws
from fp8_support import CASES, expected_refusals, model_dirs, weightsync_fp8

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dirs = model_dirs(str(tmp_path_factory.mktemp("fp8")))
    run = subprocess.run([sys.executable, os.path.join(HERE, "fp8_models.py"), "vllm",
                          *dirs.values()], capture_output=True, text=True, timeout=600)
    line = [x for x in run.stdout.splitlines() if x.startswith("FP8-MODELS ")]
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(line[0][len("FP8-MODELS "):])
    serialized = [x for x in run.stdout.splitlines() if x.startswith("FP8-SERIALIZED ")]
    assert serialized, run.stdout[-2000:]
    facts = json.loads(serialized[0][len("FP8-SERIALIZED "):])
    return ({case: got[d] for case, d in dirs.items()}, dirs,
            {case: facts[d] for case, d in dirs.items()})


def engine_names(params: dict) -> dict:
    # vLLM 0.32 holds the routed experts one module down (RoutedExperts).
    return {n.replace(".experts.routed_experts.", ".experts."): v for n, v in params.items()}


@pytest.mark.parametrize("case", [c for c in CASES if c not in expected_refusals("vllm")])
def test_fp8_params_are_the_engines(built, case):
    got, dirs, _ = built
    assert "error" not in got[case], got[case]
    theirs = engine_names(got[case])
    ours = weightsync_fp8(dirs[case], "vllm")
    assert ours == theirs, {"only weightsync": sorted(set(ours) - set(theirs)),
                            "only vLLM": sorted(set(theirs) - set(ours)),
                            "differ": sorted(n for n in ours if n in theirs
                                             and ours[n] != theirs[n])}


@pytest.mark.parametrize("case", sorted(expected_refusals("vllm")))
def test_a_model_vllm_refuses_is_refused(built, case):
    got, dirs, _ = built
    assert "Detected some but not all shards" in got[case].get("error", ""), got[case]
    with pytest.raises(ws.Error, match=expected_refusals("vllm")[case]):
        weightsync_fp8(dirs[case], "vllm")


def test_load_weights_into_an_fp8_checkpoint_is_refused(built, tmp_path):
    """load_weights mode (framework "hf": weightsync hands HF tensors to
    vLLM's loaders) into a model vLLM loads from an FP8-serialized
    checkpoint: vLLM would copy BF16 into its FP8 params without new scales.
    The check vLLM workers run at connect refuses it, naming the way that
    works; a BF16 checkpoint (no quantization_config) passes."""
    from weightsync._parity import check_load_weights

    got, dirs, serialized = built
    for case in ("qwen3_moe", "deepseek_v3"):
        assert serialized[case] is True, (case, serialized)  # vLLM's own reading
        hf = {"framework": "hf", "hf_config": os.path.join(dirs[case], "config.json"), "tp": 1,
              "replicas": 1, "dtype": "BF16"}
        with pytest.raises(ws.MismatchError, match="serves an FP8 checkpoint") as refused:
            check_load_weights(hf, 0, 0, serialized[case])
        assert "BF16" in str(refused.value) and "framework 'vllm'" in str(refused.value)
        check_load_weights(dict(hf, framework="vllm"), 0, 0, serialized[case])  # sends FP8
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    config = json.load(open(os.path.join(dirs["qwen3_moe"], "config.json")))
    del config["quantization_config"]
    (bf16 / "config.json").write_text(json.dumps(config))
    check_load_weights({"framework": "hf", "hf_config": str(bf16 / "config.json"), "tp": 1,
                        "replicas": 1, "dtype": "BF16"}, 0, 0, False)


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_quantizer_is_bit_exact_with_vllms(tmp_path, scale):
    """weightsync's quantizer (`weightsync materialize`) against vLLM 0.32's
    own reference quantizer (vllm.utils.deep_gemm.per_block_cast_to_fp8, torch
    on the CPU) on adversarial BF16 weights: every code byte and scale."""
    import torch
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from fp8_support import materialize_fp8

    ckpt, got = materialize_fp8(str(tmp_path), "tiny-fp8-llama", scale)
    checked = 0
    for key, w in ckpt.items():
        if key + "_scale_inv" not in got:
            continue
        q, s = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=scale == "ue8m0")
        assert torch.equal(got[key].view(torch.uint8), q.view(torch.uint8)), key
        assert torch.equal(got[key + "_scale_inv"], s), key
        checked += 1
    assert checked == 14  # q, k, v, o, gate, up, down of each of the 2 layers
