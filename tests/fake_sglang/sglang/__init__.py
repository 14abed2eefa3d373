"""A stand-in `sglang` package for the engine tests: `python -m sglang.launch_server` with SGLang's flags."""
