"""weightsync's own errors through an engine's error reporting, without the
engine: a vLLM worker's weightsync.Error reaches the process that owns the
LLM only as text inside vLLM's message; weightsync.vllm reads the code and
the message back from it (the real engine: tests/real_engines/test_vllm.py,
test_failed_step_under_receive_raises_weightsyncs_reason)."""

from __future__ import annotations

import pickle

import weightsync as ws
import weightsync.vllm as wsv


def _as_vllm_reports(error: BaseException) -> RuntimeError:
    # vLLM 0.32's multiprocess executor (v1/executor/multiproc_executor.py)
    return RuntimeError(f"Worker failed with error '{error}', please check the stack trace "
                        "above for the root cause")


def test_a_workers_error_comes_back_with_its_code_and_message():
    message = ("weightsync: engine rank 3 (replica 1, tensor-parallel rank 1): step 7 was not "
               "committed: step aborted: trainer rank 0: connection closed (the engine keeps "
               "version 6; it's restored)")
    raised = wsv.marked(ws.Error("peer_failure", message))
    assert isinstance(raised, ws.PeerFailure)
    back = wsv.worker_error(_as_vllm_reports(raised), "update_weights")
    assert isinstance(back, ws.PeerFailure) and back.code == "peer_failure"
    assert back.message == message  # quotes and all
    # vLLM's RPC layer may pass the bare text, or the error itself (in-process executors)
    assert wsv.worker_error(RuntimeError(str(raised)), "x").message == message
    assert wsv.worker_error(raised, "x") is raised
    assert pickle.loads(pickle.dumps(back)).message == message


def test_every_code_survives_the_trip():
    for code in ("timeout", "mismatch", "invalid_argument", "internal"):
        back = wsv.worker_error(_as_vllm_reports(wsv.marked(ws.Error(code, "why"))), "call")
        assert (back.code, back.message) == (code, "why")
        assert isinstance(back, ws.error_class(code))


def test_an_error_of_vllm_itself_is_named_as_such():
    back = wsv.worker_error(RuntimeError("Worker failed with error 'CUDA out of memory'"),
                            "update_weights")
    assert back.code == "internal"
    assert "vLLM's update_weights failed" in back.message and "out of memory" in back.message
