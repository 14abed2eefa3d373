"""Inference engines the worker can drive: SGLang itself, a server started elsewhere, or the stand-in stub.

`base` owns an engine's lifecycle (start, readiness, health, stop); `sglang`, `stub` and `external` are the
kinds, `kinds.make_engine` picks one by `[engine] kind`. `sglang_flags` (SGLang's own flag table, read by the
spec) and the stub's server (`stub_server`, a program of its own) live here too. This `__init__` imports
nothing, so that reading a spec does not load the HTTP client.
"""
