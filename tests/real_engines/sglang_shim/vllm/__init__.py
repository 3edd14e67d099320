"""NOT vLLM: a test-only stand-in for the few `vllm._custom_ops` kernels that
SGLang's generic (non-CUDA) path imports when it runs on a CPU without
sglang-kernel's CPU build (tests/real_engines/sglang_procs.py puts this folder
on the path of the SGLang tests alone). Never installed, never imported by
weightsync."""
