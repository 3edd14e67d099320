"""SGLang 0.5.23 builds, from a tiny FP8 config.json, exactly the FP8 params
(and scale params) weightsync's layout of framework "sglang" has (issue 54):
the model is constructed on the meta device in one child process
(fp8_models.py, no kernels, no weights, about 40 s for all the models),
then compared with
weightsync.engine_params at tp=1. And SGLang's own UE8M0 quantizer against
weightsync's, byte for byte."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import weightsync as ws
from fp8_support import CASES, expected_refusals, materialize_fp8, model_dirs, weightsync_fp8

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dirs = model_dirs(str(tmp_path_factory.mktemp("fp8")))
    # SGLang's generic path on a CPU needs the test shims (sglang_shim/).
    path = [os.path.join(HERE, "sglang_shim")] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    run = subprocess.run([sys.executable, os.path.join(HERE, "fp8_models.py"), "sglang",
                          *dirs.values()], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    line = [x for x in run.stdout.splitlines() if x.startswith("FP8-MODELS ")]
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(line[0][len("FP8-MODELS "):])
    return {case: got[d] for case, d in dirs.items()}, dirs


@pytest.mark.parametrize("case", [c for c in CASES if c not in expected_refusals("sglang")])
def test_fp8_params_are_the_engines(built, case):
    got, dirs = built
    assert "error" not in got[case], got[case]
    ours = weightsync_fp8(dirs[case], "sglang")
    theirs = got[case]
    assert ours == theirs, {"only weightsync": sorted(set(ours) - set(theirs)),
                            "only SGLang": sorted(set(theirs) - set(ours)),
                            "differ": sorted(n for n in ours if n in theirs
                                             and ours[n] != theirs[n])}


@pytest.mark.parametrize("case", sorted(expected_refusals("sglang")))
def test_a_model_sglang_refuses_is_refused(built, case):
    got, dirs = built
    assert "Detected some but not all shards" in got[case].get("error", ""), got[case]
    with pytest.raises(ws.Error, match=expected_refusals("sglang")[case]):
        weightsync_fp8(dirs[case], "sglang")


def test_ue8m0_quantizer_is_bit_exact_with_sglangs(tmp_path):
    """weightsync's UE8M0 quantizer (`weightsync materialize`) against
    SGLang 0.5.23's per_block_cast_to_fp8 (its DeepGEMM requantization's
    reference, torch on the CPU) on adversarial BF16 weights."""
    import torch
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    ckpt, got = materialize_fp8(str(tmp_path), "tiny-fp8-llama", "ue8m0")
    checked = 0
    for key, w in ckpt.items():
        if key + "_scale_inv" not in got:
            continue
        q, s = per_block_cast_to_fp8(w)
        assert torch.equal(got[key].view(torch.uint8), q.view(torch.uint8)), key
        assert torch.equal(got[key + "_scale_inv"], s), key
        checked += 1
    assert checked == 14
