"""Inference engines the worker drives, and how it talks to them.

`base` owns an engine's lifecycle (start, readiness, health, stop), `process_group` its processes;
`sglang`, `stub` (which launches the stand-in server, `toolkit.stub`, a program of its own) and
`external` are the kinds, and `kinds.make_engine` picks one by `[engine] kind`; `sglang_python`
says which Python runs SGLang; `rank` runs one rank of an engine over several nodes, and
`rendezvous` says where they meet. `client` is the HTTP client and its errors, `endpoints` the
calls of SGLang's endpoints (`/generate` with retries, aborts, the probes), `answer` the check of a
`/generate` answer against its request, `layout` the GPU arithmetic of an engine, and
`sglang_contract` SGLang's flags and sampling checks as data, which the job's checks read. This
`__init__` imports nothing, so that reading a spec does not load the HTTP client.
"""
