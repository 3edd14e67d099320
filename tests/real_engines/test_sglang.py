"""weightsync inside real SGLang (0.5.23, tools/engines/setup_sglang.sh makes
its venv), on this machine's CPU: SGLang's generic path, with the test-only
shims of sglang_shim/ (pure-torch stand-ins for the vLLM kernels SGLang
imports there; PyNccl off for tp=2).

Each case (dense qwen3 at tp=1, MoE qwen3_moe at tp=2, DeepSeek-V3 at tp=2,
parameters only) starts one engine from checkpoint 0 with weightsync's custom
weight loader, a weightsync Coordinator here, and a trainer process (a
transformers model behind a Publisher) that pushes other checkpoints (tiny
random bf16 models, every tensor different).
The engine syncs through `weightsync.sglang.update` (SGLang's weight-update
session: the model's own load_weights, post-processing, radix-cache flush).
After every step, every parameter of every TP rank (as SGLang's own
save_sharded_model writes them) equals, bit for bit, that of a fresh engine
started from the same checkpoint, and greedy tokens from fixed token ids,
which the engine served before the sync (a stale radix cache would show),
equal the fresh engine's. A step that fails midway (a bucket never arrives)
leaves the engine on its previous version (restored, bit for bit), and the
next step commits; so does a trainer killed mid-step, replaced by a new
process in the same job.

    "$(bash tools/engines/setup_sglang.sh)/bin/python" -m pytest tests/real_engines/test_sglang.py -v
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed in this interpreter (bash "
                    "tools/engines/setup_sglang.sh makes a venv with it)")
try:
    import weightsync as ws
except ImportError as e:  # the compiled extension is missing
    pytest.skip(f"weightsync is not importable ({e}): bash run.sh build, then bash "
                "tools/engines/setup_sglang.sh", allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_versions import differing_keys, nearby_checkpoint  # noqa: E402
from sglang_procs import run_in_thread, start_engine, start_trainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# kind: (configs/models/<name>, config overrides, whether SGLang's CPU path
# can generate with it)
MODELS = {
    "dense": ("tiny-qwen3", {}, True),
    # SGLang's qwen3_moe makes every layer sparse (it ignores mlp_only_layers)
    "moe": ("tiny-qwen3-moe", {"mlp_only_layers": []}, True),
    # SGLang builds DeepSeek's rotary embedding on a CPU only for yarn
    # scaling, and its MLA prefill fails in the torch-native attention
    # backend: parameters only
    "deepseek": ("tiny-deepseek-v3", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "rope_theta": 10000.0}}, False),
}
# Dense at tp=1, MoE and DeepSeek (MLA) at tp=2: every loader path (dense
# and fused-expert weights, MLA's fused projections) and both tp=1 and tp=2
# shards. (Dense at tp=2 and MoE at tp=1 were cases too; each is its own
# SGLang engine and fresh references, about 4 minutes of CI time on a
# 2-core machine, and covers no loader path these do not.)
CASES = [("dense", 1), ("moe", 2), ("deepseek", 2)]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
NEW_TOKENS = 8
# Two checkpoints: the engine starts from 0; versions 1..STEPS are checkpoints
# 1 then 0 (each step's bytes differ from what the engine holds). Checkpoint
# 0's reference is the engine under test before its first sync (a fresh
# engine of it), so a case starts one fresh engine besides its own.
CHECKPOINTS = 2
STEP_CHECKPOINTS = [1, 0]
STEPS = len(STEP_CHECKPOINTS)
# Step STEPS + 1 fails midway: the trainer's transport drops the sends of its
# last bucket (a bucket's sends carry bucket_tag(step, bucket, 0) = step << 32
# | bucket << 1), so the engine rank it was for loads what the other buckets
# completed, then the step times out there (the engine's step_timeout). (A
# bucket dropped earlier also blocks the sends after it, beyond the buckets
# the engine receives ahead: the trainer's push then times out with an error,
# and the coordinator decides too late for the engine.)
FAILING_STEP = STEPS + 1
BUCKET_BYTES = 64 << 10
ENGINE_STEP_TIMEOUT = 20.0   # the engine gives up first: at tp=2 the rank that got all its
TRAINER_STEP_TIMEOUT = 30.0  # data commits alone, and weightsync.sglang reverts it


def log(*args):
    print("[test_sglang]", *args, file=sys.stderr, flush=True)


# ---- checkpoints and fresh-engine references ---------------------------------

@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{kind: [dir of checkpoint c]}: tiny random bf16 models, every tensor
    different in each checkpoint (made with transformers, lazily)."""
    made: dict = {}

    def get(kind):
        if kind not in made:
            made[kind] = [_make_checkpoint(kind, c, tmp_path_factory.mktemp(f"{kind}-ckpt{c}"))
                          for c in range(CHECKPOINTS)]
        return made[kind]

    return get


def _make_checkpoint(kind, seed, out):
    import transformers

    name, overrides, _ = MODELS[kind]
    with open(os.path.join(REPO, "configs", "models", name, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("torch_dtype", None)
    cfg.update(overrides, max_position_embeddings=256)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():  # parameters and persistent buffers (DeepSeek's score bias)
        for _, p in model.state_dict(keep_vars=True).items():
            if p.is_floating_point():
                scale = 0.2 if p.dim() > 1 else 1.0
                value = torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0)
                p.copy_(value.to(torch.bfloat16))  # BF16-exact also where p is FP32
    model.save_pretrained(str(out))
    return str(out)


class References:
    """reference(kind, tp, c): what a fresh engine started from checkpoint c
    answers: its tokens for PROMPTS and every rank's dumped parameters
    (computed once). c: a checkpoint's index in checkpoints(kind), or
    another checkpoint's directory."""

    def __init__(self, checkpoints, tmp_path_factory):
        self._checkpoints, self._tmp = checkpoints, tmp_path_factory
        self._cache: dict = {}

    def __call__(self, kind, tp, c):
        key = (kind, tp, c)
        if key not in self._cache:
            path = self._checkpoints(kind)[c] if isinstance(c, int) else c
            engine = start_engine(path, tp)
            try:
                log(f"fresh engine {kind} tp={tp} checkpoint {c}: started in "
                    f"{engine.call('started_in'):.1f} s")
                self.record(kind, tp, c, engine)
            finally:
                engine.close()
        return self._cache[key]

    def record(self, kind, tp, c, engine):
        """Takes the reference of checkpoint c from `engine`, started from it
        and not updated since: it is a fresh engine of c (the engine under
        test, before its first sync, saves starting one more)."""
        assert (kind, tp, c) not in self._cache, (kind, tp, c)
        tokens = [o["tokens"] for o in _generate(engine)] if MODELS[kind][2] else None
        dump = str(self._tmp.mktemp(f"ref-{kind}-tp{tp}"))
        engine.call("dump", path=dump)
        self._cache[(kind, tp, c)] = {"tokens": tokens, "params": _load_dump(dump, tp)}


@pytest.fixture(scope="session")
def references(checkpoints, tmp_path_factory):
    return References(checkpoints, tmp_path_factory)


def _generate(engine):
    return engine.call("generate", prompts=PROMPTS, max_new_tokens=NEW_TOKENS)


def _load_dump(path, tp):
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    ranks = []
    for r in range(tp):
        mine = [f for f in files if f.startswith(f"model-rank-{r}-")]
        assert mine, f"no parameters of rank {r} in {files}"
        tensors = {}
        for f in mine:
            tensors.update(load_file(os.path.join(path, f)))
        ranks.append(tensors)
    return ranks


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


# ---- the engine under test ---------------------------------------------------

def _buckets(checkpoint, engine_config, tmp):
    """How many buckets a step has (`weightsync plan`)."""
    import weightsync.torch as wst
    from sglang_procs import trainer_model

    layout = os.path.join(tmp, "trainer.json")
    engine = os.path.join(tmp, "engine.json")
    with open(layout, "w") as f:
        json.dump(wst.trainer_layout(trainer_model(checkpoint)), f)
    with open(engine, "w") as f:
        json.dump(engine_config, f)
    out = subprocess.run([ws.cli_path(), "plan", "--trainer", layout, "--engine", engine,
                          "--bucket-bytes", str(BUCKET_BYTES), "--json"],
                         capture_output=True, text=True, check=True)
    buckets = json.loads(out.stdout)["buckets"]
    assert buckets >= 2, f"the failing step needs two buckets or more: {buckets}"
    return buckets


class Live:
    """A running engine, connected to weightsync, what it serves, and its
    trainer (one process for the whole case: its transport drops the last
    bucket of step FAILING_STEP, and nothing else)."""

    def __init__(self, kind, tp, engine, coord, config, ckpts, tmp):
        self.kind, self.tp, self.engine, self.coord = kind, tp, engine, coord
        self.config, self.ckpts = config, ckpts
        self.version, self.checkpoint = -1, 0  # what it serves
        self._trainer = None
        self.buckets = _buckets(ckpts[0], config, tmp)

    def trainer(self, **options):
        options.setdefault("bucket_bytes", BUCKET_BYTES)
        options.setdefault("step_timeout", 60.0)
        return start_trainer(self.coord.address, self.config, self.ckpts, **options)

    @property
    def main_trainer(self):
        if self._trainer is None:
            tag = (FAILING_STEP << 32) | ((self.buckets - 1) << 1)
            self._trainer = self.trainer(transport=f"fault:ucx?drop_send=1&tag={tag}",
                                         step_timeout=TRAINER_STEP_TIMEOUT)
        return self._trainer

    def close(self):
        if self._trainer is not None:
            self._trainer.close()

    def sync(self, step, checkpoint, trainer=None, may_fail=False):
        """The trainer pushes checkpoint `checkpoint` as version `step` while
        the engine updates; both results (with `may_fail`, a push that raised
        gives {"error": its traceback})."""
        trainer = trainer or self.main_trainer
        trainer.send("push", step=step, checkpoint=checkpoint)
        try:
            out = self.engine.call("update", timeout=120.0)
        except BaseException:
            try:  # the push's answer, so that the trainer can be used again
                trainer.result("push", timeout=120)
            except AssertionError:
                pass
            raise
        try:
            pushed = trainer.result("push", timeout=300)
        except AssertionError as e:
            if not may_fail:
                raise
            pushed = {"error": str(e)}
        return out, pushed

    def check(self, reference, tmp_path, version):
        """Every parameter of every rank, bit for bit, and the greedy tokens
        (the radix cache flushed: nothing cached on the first serving) equal
        the fresh engine's; SGLang reports `version`."""
        outs = None
        if MODELS[self.kind][2]:
            outs = _generate(self.engine)
            assert all(not o["cached_tokens"] for o in outs), \
                f"the radix cache was not flushed: {outs}"
            assert [o["tokens"] for o in outs] == reference["tokens"], \
                "greedy tokens differ from a fresh engine's"
            assert all(o["weight_version"] == str(version) for o in outs), outs
        assert self.engine.call("weight_version") == str(version)
        dump = str(tmp_path / f"dump-v{version}-{time.monotonic_ns()}")
        self.engine.call("dump", path=dump)
        got = _load_dump(dump, self.tp)
        for r, (mine, want) in enumerate(zip(got, reference["params"])):
            assert sorted(mine) == sorted(want), f"rank {r}: other parameter names"
            differ = [n for n in want if mine[n].shape != want[n].shape
                      or mine[n].dtype != want[n].dtype
                      or not torch.equal(_bits(mine[n]), _bits(want[n]))]
            assert not differ, f"rank {r}: {len(differ)} of {len(want)} parameters differ " \
                f"from a fresh engine's: {differ[:6]}"
        return outs


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def live(request, checkpoints, references, tmp_path_factory):
    kind, tp = request.param
    ckpts = checkpoints(kind)
    config = {"framework": "hf", "hf_config": os.path.join(ckpts[0], "config.json"), "tp": tp,
              "dtype": "BF16"}
    with ws.Coordinator() as coord:
        engine = start_engine(ckpts[0], tp)
        try:
            log(f"engine under test {kind} tp={tp}: started in "
                f"{engine.call('started_in'):.1f} s")
            references.record(kind, tp, 0, engine)
            ranks = engine.call("connect", coordinator=coord.address, engine_config=config,
                                replica=0, mode="load_weights",
                                step_timeout=ENGINE_STEP_TIMEOUT)
            assert [r["rank"] for r in ranks] == list(range(tp))
            assert all(r["version"] == -1 and r["mode"] == "load_weights" for r in ranks)
            if MODELS[kind][2]:
                # served before any sync: the radix cache holds these prompts' KV
                outs = _generate(engine)
                assert all(o["weight_version"] == "default" for o in outs)
                again = _generate(engine)
                assert any(o["cached_tokens"] for o in again), "the radix cache was not used"
            live = Live(kind, tp, engine, coord, config, ckpts,
                        str(tmp_path_factory.mktemp(f"plan-{kind}-tp{tp}")))
            try:
                yield live
            finally:
                live.close()
        finally:
            engine.close()


@pytest.fixture(scope="session")
def delta_versions(tmp_path_factory):
    """versions(held) -> (nearby, partial): checkpoints about 1 % of the
    elements away from `held`, and 5 % of layer 1's only (made once)."""
    made: dict = {}

    def get(held):
        if held not in made:
            out = tmp_path_factory.mktemp("delta-versions")
            nearby = nearby_checkpoint(held, str(out / "nearby"), seed=11)
            partial = nearby_checkpoint(held, str(out / "partial"), seed=18, fraction=0.05,
                                        prefix="model.layers.1.")
            made[held] = (nearby, partial)
        return made[held]

    return get


# ---- the tests ---------------------------------------------------------------

def _other(checkpoint):
    """The checkpoint the engine does not hold."""
    return 1 - checkpoint


def test_steps_equal_fresh_engines(live, references, tmp_path):
    for step, checkpoint in enumerate(STEP_CHECKPOINTS, start=1):
        t = time.monotonic()
        out, pushed = live.sync(step, checkpoint=checkpoint)
        log(f"{live.kind} tp={live.tp} step {step}: update {time.monotonic() - t:.2f} s, "
            f"{[r['outcome']['bytes'] for r in out['ranks']]} bytes per rank")
        assert pushed["committed"] == list(range(live.tp)) and not pushed["failed"], pushed
        assert out["step"] == step and out["committed"] and out["version"] == step, out
        assert all(r["outcome"]["batches"] > 0 and not r["outcome"]["restored"]
                   for r in out["ranks"]), out
        live.version, live.checkpoint = step, checkpoint
        live.check(references(live.kind, live.tp, checkpoint), tmp_path, step)


def test_step_failing_midway_leaves_previous_version(live, references, tmp_path):
    """Bucket 1 of the step never arrives: every rank that loaded tensors of
    it restores the previous version (bit for bit, tokens too), SGLang's
    weight version stays; the next step commits."""
    if live.version != FAILING_STEP - 1:
        pytest.skip("needs versions 1..STEPS committed (test_steps_equal_fresh_engines)")
    before, new = live.checkpoint, _other(live.checkpoint)
    t = time.monotonic()
    out, pushed = live.sync(FAILING_STEP, checkpoint=new, may_fail=True)
    log(f"{live.kind} tp={live.tp} failing step {FAILING_STEP} ({time.monotonic() - t:.1f} s): "
        f"{out}")
    # the trainer's push fails (or raises: a send the engine gave up on timed out)
    assert "error" in pushed or pushed["committed"] != list(range(live.tp)), pushed
    assert out["step"] == FAILING_STEP and not out["committed"], out
    assert out["version"] == live.version, out
    committed = [r["rank"] for r in out["ranks"] if r["outcome"]["committed"]]
    assert out.get("reverted", []) == committed, out  # ranks that committed alone went back
    assert any(r["outcome"]["batches"] > 0 for r in out["ranks"]), \
        f"the engine loaded nothing of the step: the test did not test a restore: {out}"
    assert all(r["outcome"]["restored"] == (r["outcome"]["batches"] > 0)
               for r in out["ranks"] if not r["outcome"]["committed"]), out
    live.check(references(live.kind, live.tp, before), tmp_path, live.version)

    out, pushed = live.sync(FAILING_STEP + 1, checkpoint=new)
    assert pushed["committed"] == list(range(live.tp)), pushed
    assert out["committed"] and out["version"] == FAILING_STEP + 1, out
    live.version, live.checkpoint = FAILING_STEP + 1, new
    live.check(references(live.kind, live.tp, new), tmp_path, live.version)


def test_trainer_killed_mid_step_then_a_new_trainer_commits(live, references, tmp_path):
    if (live.kind, live.tp) != ("dense", 1):
        pytest.skip("run for dense-tp1 only (engine starts are slow)")
    if live.version < 0:
        pytest.skip("needs a committed version first")
    live.close()  # the case's trainer leaves; a new one comes, and is killed mid-step
    live._trainer = None
    before, new = live.checkpoint, _other(live.checkpoint)
    step = live.version + 1
    bad = live.trainer(transport=f"fault:ucx?drop_send=1&tag={(step << 32) | (1 << 1)}")
    try:
        bad.send("push", step=step, checkpoint=new)
        join = run_in_thread(lambda: live.engine.call("update", timeout=120.0))
        time.sleep(12)
        bad.kill()
        out = join()
    finally:
        bad.kill()
    log(f"{live.kind} tp={live.tp} killed trainer, step {step}: {out}")
    assert out["step"] == step and not out["committed"], out
    assert out["version"] == live.version, out
    assert any(r["outcome"]["batches"] > 0 for r in out["ranks"]), \
        f"the engine loaded nothing before the kill: the test did not test a restore: {out}"
    live.check(references(live.kind, live.tp, before), tmp_path, live.version)

    good = live.trainer()
    try:
        out, pushed = live.sync(step + 1, checkpoint=new, trainer=good)
    finally:
        good.close()
    assert out["committed"] and out["version"] == step + 1, out
    live.version, live.checkpoint = step + 1, new
    live.check(references(live.kind, live.tp, new), tmp_path, step + 1)


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_delta_sync_moves_only_the_changes(live, references, delta_versions, tmp_path, mode):
    """delta="auto" through SGLang's weight-update session (load_weights
    mode, tp=2, MoE): a new trainer process's first step goes whole, then
    versions about 1 % of the elements apart go as deltas of a small part of
    the bytes, each onto what the last delta made; after every step each
    rank's parameters and the greedy tokens equal a fresh engine's of that
    version. In both plan modes (the new trainer's: the engines follow it;
    broadcast: one delta for both ranks, each checking what it reads). Each
    rank loads only the tensors that changed (WorkerSync's changed_only):
    every one at the whole step, the ones that differ after it, and at a last
    version that moves only layer 1 (a partly frozen model), only those.
    Both modes push the same versions (their fresh engines start once)."""
    if (live.kind, live.tp) != ("moe", 2):
        pytest.skip("run for moe-tp2 only (engine starts are slow)")
    if live.version < 0:
        pytest.skip("needs a committed version first")
    live.close()  # the case's trainer leaves; one with delta on takes rank 0
    live._trainer = None
    held = live.ckpts[live.checkpoint]
    nearby, partial = delta_versions(held)
    moved, moved_partly = differing_keys(held, nearby), differing_keys(held, partial)
    assert 0 < len(moved_partly) < len(moved), (moved, moved_partly)
    trainer = start_trainer(live.coord.address, live.config, [held, nearby, held, partial],
                            delta="auto", bucket_bytes=BUCKET_BYTES, step_timeout=60.0,
                            mode=mode)
    try:
        steps, loaded = [], []
        # held -> nearby (whole: nothing to diff against yet), then deltas:
        # -> held -> nearby -> held -> partial
        for index, version_dir in ((1, nearby), (2, held), (1, nearby), (2, held), (3, partial)):
            step = live.version + 1
            out, pushed = live.sync(step, checkpoint=index, trainer=trainer)
            assert pushed["committed"] == list(range(live.tp)) and not pushed["failed"], pushed
            assert out["committed"] and out["version"] == step, out
            live.version = step
            reference = (references(live.kind, live.tp, version_dir) if version_dir != held
                         else references(live.kind, live.tp, live.checkpoint))
            live.check(reference, tmp_path, step)
            steps.append((pushed, [r["outcome"]["delta_buckets"] for r in out["ranks"]]))
            loaded.append([r["outcome"]["weights_handed"] for r in out["ranks"]])
            log(f"{live.kind} tp={live.tp} {mode} delta step {step}: "
                f"{pushed['bytes_sent']} bytes sent, "
                f"{pushed['delta_buckets']} delta buckets; per engine rank {steps[-1][1]}, "
                f"tensors loaded {loaded[-1]}")
    finally:
        trainer.close()
    (whole, whole_ranks), *deltas = steps
    assert whole["delta_buckets"] == 0 and whole_ranks == [0] * live.tp, steps
    for pushed, ranks in deltas:
        assert pushed["delta_buckets"] > 0 and all(n > 0 for n in ranks), steps
        if mode == "p2p":  # a bucket for each rank
            assert sum(ranks) == pushed["delta_buckets"], steps
        else:  # every bucket for both ranks
            assert ranks == [pushed["delta_buckets"]] * live.tp, steps
        assert pushed["bytes_sent"] * 4 < whole["bytes_sent"], steps
    # Every rank receives every HF tensor whole (framework "hf") and loads
    # the ones that changed.
    assert loaded[0][0] >= len(moved) and loaded[0] == [loaded[0][0]] * live.tp, loaded
    assert loaded[1:4] == [[len(moved)] * live.tp] * 3, (loaded, moved)
    assert loaded[4] == [len(moved_partly)] * live.tp, (loaded, moved_partly)


def test_step_left_mixed_raises_weightsyncs_reason(live, references, tmp_path):
    """restore=False: a step that fails after the model loaded part of it
    leaves the rank mixed, and update() raises weightsync's own error naming
    the step, the rank and why the step failed (generation paused); the next
    committed step makes the rank whole and generation resumes."""
    if (live.kind, live.tp) != ("dense", 1):
        pytest.skip("run for dense-tp1 only (engine starts are slow)")
    if live.version < 0:
        pytest.skip("needs a committed version first")

    def good_step():
        step, checkpoint = live.version + 1, _other(live.checkpoint)
        if step == FAILING_STEP:  # the case's trainer drops a bucket of that one
            step += 1
        out, _ = live.sync(step, checkpoint=checkpoint)
        assert out["committed"], out
        live.version, live.checkpoint = step, checkpoint

    # The case's trainer (a new process where a test above replaced it) takes
    # part in a step before the engine connects anew, without snapshots, and
    # in one after: a connection knows a trainer process's address only once
    # it has talked with it, and then waits for the next process's own when
    # a new one takes the rank over (as in the test above).
    good_step()
    live.engine.call("connect", coordinator=live.coord.address, engine_config=live.config,
                     replica=0, mode="load_weights", step_timeout=ENGINE_STEP_TIMEOUT,
                     restore=False)
    good_step()
    live.close()  # the case's trainer leaves; this test's trainers take rank 0
    live._trainer = None
    step, new = live.version + 1, _other(live.checkpoint)
    tag = (step << 32) | ((live.buckets - 1) << 1)  # its last bucket never arrives
    bad = live.trainer(transport=f"fault:ucx?drop_send=1&tag={tag}",
                       step_timeout=TRAINER_STEP_TIMEOUT)
    try:
        bad.send("push", step=step, checkpoint=new)
        got = live.engine.call("update_raising", timeout=120.0)
        try:
            bad.result("push", timeout=120)
        except AssertionError:
            pass  # the push fails too
    finally:
        bad.close()
    log(f"{live.kind} tp={live.tp} mixed step {step}: {got}")
    raised = got.get("raised")
    assert raised is not None, f"update() did not raise: {got}"
    assert raised["weightsync"] and raised["code"] == "cancelled", raised
    for part in (f"step {step}", "SGLang rank 0", "restore=False", "generation is paused"):
        assert part in raised["message"], (part, raised)
    # the reason the step failed there, not only that the model is mixed
    assert "was not committed on SGLang rank 0: " in raised["message"], raised
    reason = raised["message"].split("was not committed on SGLang rank 0: ", 1)[1]
    assert not reason.startswith("no reason given"), raised
    assert "Traceback" not in raised["message"], "a hook's failure is one line, not its stack"

    good = live.trainer()
    try:
        out, pushed = live.sync(step + 1, checkpoint=new, trainer=good)
        assert out["committed"] and out["version"] == step + 1, out
        live.version, live.checkpoint = step + 1, new
        live.check(references(live.kind, live.tp, new), tmp_path, step + 1)
        # Snapshots again, for whatever runs next on this engine.
        live.engine.call("connect", coordinator=live.coord.address, engine_config=live.config,
                         replica=0, mode="load_weights", step_timeout=ENGINE_STEP_TIMEOUT)
    finally:
        good.close()
