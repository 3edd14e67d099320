"""What both of weightsync's ways into a vLLM worker share (the worker
extension of weightsync.vllm and the weight-transfer engine of
weightsync._vllm_transfer), and the process that drives them (the trainer
engine of weightsync._vllm_trainer): the backend's name, the worker's
tensor-parallel rank, its LoRA adapter jobs, and the marking of errors that
vLLM passes on as text. Imports no other integration module, so that those
import it and not each other (tools/check_architecture.py refuses a circle).
vLLM is imported only where a function needs it.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ._errors import Error

#: The name weightsync's weight-transfer engine is registered under.
ENGINE_NAME = "weightsync"


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _lora_connect(adapters: dict, model: Any, vllm_config: Any, coordinator: Any, engine: Any,
                  replica: int, rank: int, options: dict) -> tuple:
    """Connects one worker to an adapter job; `adapters`: {name: EngineSync}
    of the worker's adapters (the new one replaces one of its name)."""
    from ._vllm_lora import connect_lora
    from .lora import adapter_of

    wanted = adapter_of(engine)
    if wanted is not None:
        for name, sync in adapters.items():
            if name != wanted["name"] and sync.protocol.id == wanted["id"]:
                raise Error("invalid_argument", f"adapter {wanted['name']!r}: id {wanted['id']} "
                            f"is adapter {name!r}'s on this engine (each adapter its own id)")
        old = adapters.pop(wanted["name"], None)
        if old is not None:
            old.close()
    adapter, sync = connect_lora(model, vllm_config, coordinator, engine, replica, rank,
                                 **options)
    adapters[adapter["name"]] = sync
    return adapter, sync


def _lora_sync(adapters: dict, name: str) -> Any:
    sync = adapters.get(name)
    if sync is None:
        have = ", ".join(repr(n) for n in sorted(adapters)) or "none"
        raise Error("not_found", f"adapter {name!r} is not connected on this worker (connected: "
                    f"{have}); connect it first (weightsync.vllm.connect_lora)")
    return sync


def _lora_close(adapters: dict, name: Optional[str]) -> None:
    for n in [name] if name is not None else list(adapters):
        sync = adapters.pop(n, None)
        if sync is not None:
            sync.close()


# A weightsync.Error raised in a vLLM worker reaches the process that owns
# the LLM only as text inside vLLM's message ("Worker failed with error
# '...', please check ..."): workers mark it with its code, and worker_error
# reads both back.
_MARKED = re.compile(r"\[weightsync:(\w+)\] (.*?)(?:', please check the stack trace|'?\s*$)",
                     re.S)


def marked(error: Error) -> Error:
    """`error` as a worker raises it into vLLM: its message marked with its
    code, for worker_error."""
    return Error(error.code, f"[weightsync:{error.code}] {error.message}")


def worker_error(error: BaseException, call: str) -> Error:
    """The weightsync.Error a worker raised, from the exception vLLM's
    collective `call` raised with its text; vLLM's own error otherwise."""
    if isinstance(error, Error):
        return error
    found = _MARKED.search(str(error))
    if found is None:
        return Error("internal", f"weightsync: vLLM's {call} failed: {error}")
    return Error(found.group(1), found.group(2))


def _live_requests(worker: Any) -> dict:
    """{request id: output tokens so far} of every request the worker's
    model runner holds, read inside update_weights: the engine core runs it
    between two engine steps with the scheduler paused, so no token is being
    made, and (CPU: vLLM schedules synchronously there) every token sampled
    is in output_token_ids. Requests aborted by /pause?mode=abort are gone
    by then; one that finished in the engine step just before may still be
    held: listed with all its tokens, none after. With asynchronous
    scheduling (vLLM's default on GPUs) a sampled token may not be in the
    list yet: not measured here. The ids are the engine's: vLLM adds
    "-" and 8 random characters to the id the API server gave (an OpenAI
    completion: its response id, "-", the prompt's index)."""
    runner = getattr(worker, "model_runner", None)
    requests = getattr(runner, "requests", None)
    if not isinstance(requests, dict):
        return {}
    return {str(rid): len(getattr(state, "output_token_ids", None) or ())
            for rid, state in list(requests.items())}
