"""weightsync._derive: probe tensors and the segments decoded from what a
loader wrote (tests/real_engines/test_vllm.py traces real vLLM; here, loaders
written in the test show the decoding on its own, edge cases included)."""

from __future__ import annotations

import pytest
import torch

from weightsync import Error, _derive


def _trace(shapes: dict, params: dict, loader) -> dict:
    """Runs _derive.trace over `shapes` (HF key -> shape) into stand-ins of
    `params` (name -> shape) with `loader(params, key, probe)`."""
    keys = sorted(shapes)
    stand = {}

    def install(group):
        stand.clear()
        for name, shape in params.items():
            if _derive.layer_group(name) == group:
                stand[name] = _derive.target(shape)
        return dict(stand)

    def load(batch):
        for key, probe in batch:
            loader(stand, key, probe)

    found = _derive.trace(keys, [shapes[k] for k in keys], [_derive.layer_group(k) for k in keys],
                          load, install, lambda: stand.clear())
    return {name: [(keys[t], h, p) for t, h, p in segs] for name, segs in found.items()}


def test_fused_sliced_stacked_and_padded_params():
    tp_rank, tp = 1, 2
    shapes = {"layers.0.q.weight": [8, 4], "layers.0.k.weight": [4, 4],
              "layers.0.o.weight": [4, 8], "layers.0.norm.weight": [4],
              "layers.0.experts.0.up.weight": [6, 4], "layers.0.experts.1.up.weight": [6, 4],
              "embed.weight": [5, 4]}
    params = {"layers.0.qk.weight": [6, 4], "layers.0.o.weight": [4, 4],
              "layers.0.norm.weight": [4], "layers.0.w13.weight": [2, 3, 4],
              "embed.weight": [4, 4]}

    def loader(stand, key, probe):
        if key.endswith((".q.weight", ".k.weight")):  # fused along rows, this rank's half
            half = probe.shape[0] // tp
            rows = probe[tp_rank * half:(tp_rank + 1) * half]
            at = 0 if ".q." in key else 4
            stand["layers.0.qk.weight"][at:at + half].copy_(rows)
        elif key.endswith(".o.weight"):  # row parallel: this rank's columns
            stand["layers.0.o.weight"].copy_(probe[:, 4 * tp_rank:4 * tp_rank + 4])
        elif ".experts." in key:  # stacked experts, half of each one's rows
            e = int(key.split(".")[3])
            stand["layers.0.w13.weight"][e].copy_(probe[3 * tp_rank:3 * tp_rank + 3])
        elif key == "embed.weight":  # vocab parallel, padded past the vocab
            rows = probe[4 * tp_rank:4 * tp_rank + 4]
            stand["embed.weight"][:rows.shape[0]].copy_(rows)
        else:
            stand[key].copy_(probe)

    found = _trace(shapes, params, loader)
    assert sorted(found["layers.0.qk.weight"]) == [
        ("layers.0.k.weight", ([2, 0], [2, 4]), ([4, 0], [2, 4])),
        ("layers.0.q.weight", ([4, 0], [4, 4]), ([0, 0], [4, 4]))]
    assert found["layers.0.o.weight"] == [("layers.0.o.weight", ([0, 4], [4, 4]),
                                           ([0, 0], [4, 4]))]
    assert found["layers.0.norm.weight"] == [("layers.0.norm.weight", ([0], [4]), ([0], [4]))]
    assert sorted(found["layers.0.w13.weight"]) == [
        ("layers.0.experts.0.up.weight", ([3, 0], [3, 4]), ([0, 0, 0], [1, 3, 4])),
        ("layers.0.experts.1.up.weight", ([3, 0], [3, 4]), ([1, 0, 0], [1, 3, 4]))]
    # Row 4 of the vocab is this rank's only one; the rest is padding.
    assert found["embed.weight"] == [("embed.weight", ([4, 0], [1, 4]), ([0, 0], [1, 4]))]


def test_untouched_params_are_left_out_and_groups_stay_apart():
    shapes = {"layers.0.a.weight": [2, 2], "layers.1.a.weight": [2, 2]}
    params = {"layers.0.a.weight": [2, 2], "layers.1.a.weight": [2, 2],
              "lm_head.weight": [2, 2]}  # tied: the loader never writes it
    found = _trace(shapes, params, lambda stand, key, probe: stand[key].copy_(probe))
    assert sorted(found) == ["layers.0.a.weight", "layers.1.a.weight"]


@pytest.mark.parametrize("how,match", [
    ("scale", "transforms the values"),    # e.g. a norm stored as weight - 1
    ("cast", "transforms the values|not in row blocks"),  # a lossy cast on the way
    ("transpose", "not in row blocks"),    # a transposing loader
])
def test_loaders_that_change_values_or_order_are_refused(how, match):
    shapes = {"w.weight": [64, 64]}
    params = {"w.weight": [64, 64]}

    def loader(stand, key, probe):
        if how == "scale":
            stand[key].copy_(probe + 0.5)
        elif how == "cast":
            stand[key].copy_(probe.to(torch.float32).to(torch.float64))
        else:
            stand[key].copy_(probe.t())

    with pytest.raises(Error, match=match) as e:
        _trace(shapes, params, loader)
    assert "w.weight" in str(e.value)


def test_probe_values_are_exact_and_bounded():
    p = _derive.probe(3, [2, 3])
    assert p.dtype == torch.float64
    assert [int(v) - (4 << 32) for v in p.reshape(-1)] == list(range(6))
    with pytest.raises(Error, match="past what a float64 probe encodes"):
        _derive.probe(1 << 21, [1])
