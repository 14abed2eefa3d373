"""Build a tiny Llama model that real SGLang serves on a CPU, from a tokenizer folder, with no hub.

Random weights from a fixed seed (the same files every time): a model whose outputs are noise, but every path
of SGLang the toolkit talks to (HTTP server, tokenizer manager, scheduler, KV pool, aborts, loads, readiness,
shutdown) is SGLang's own. Needs torch and transformers (the SGLang test environment has both).

    python tests/real_sglang/tiny_model.py TOKENIZER_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def build(tokenizer_dir: Path, out: Path, *, seed: int = 0, context: int = 8192) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    old = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=old.get("vocab_size", len(tok)),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=context,
        bos_token_id=old.get("bos_token_id"),
        eos_token_id=old.get("eos_token_id"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(build(a.tokenizer_dir, a.out, seed=a.seed))


if __name__ == "__main__":
    main()
