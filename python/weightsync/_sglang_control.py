"""Control of a running SGLang engine from the process that owns it, shared
by weightsync.sglang (weight updates) and weightsync._sglang_lora (adapter
updates), which import this module and not each other
(tools/check_architecture.py refuses a circle). SGLang is imported only where
a function needs it.
"""

from __future__ import annotations

from typing import Any

from ._errors import Error


def _pause(engine: Any, pause: bool) -> None:
    """Pauses SGLang's generation (requests wait, "retract" mode), or resumes
    it if weightsync paused it."""
    if bool(getattr(engine, "_weightsync_paused", False)) == pause:
        return
    manager, loop = getattr(engine, "tokenizer_manager", None), getattr(engine, "loop", None)
    if manager is not None and loop is not None:
        from sglang.srt.managers.io_struct import (ContinueGenerationReqInput,
                                                   PauseGenerationReqInput)

        if pause:
            loop.run_until_complete(manager.pause_generation(PauseGenerationReqInput(
                mode="retract")))
        else:
            loop.run_until_complete(manager.continue_generation(ContinueGenerationReqInput()))
    else:
        request = getattr(engine, "_make_request", None)  # sglang's HttpServerEngineAdapter
        if not callable(request):
            raise Error("unsupported", f"cannot {'pause' if pause else 'resume'} generation of "
                        f"{type(engine).__name__}")
        request("pause_generation" if pause else "continue_generation",
                {"mode": "retract"} if pause else {})
    engine._weightsync_paused = pause
