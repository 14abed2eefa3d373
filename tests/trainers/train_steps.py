"""Runs in the trainer tier's virtualenv: a few SpecForge training steps of an EAGLE-3 draft on the CPU, from the rows
of a `tokens` export, on a tiny random Llama target built here from the run's tokenizer.

    python train_steps.py TOKENS.jsonl TOKENIZER WORKDIR STEPS OUT.json

SpecForge 0.2.0 trains online only through an SGLang capture server and offline from hidden-state files; neither
capture runs on this CPU, so this file stands in for the capture: the target's hidden states of each row's exact
`input_ids` (the final state and three auxiliary layers, as SpecForge's capture stores them) are written with the
row's `loss_mask` to the `.ckpt` files its offline loader reads. The training itself is SpecForge's own
(`specforge train`, offline, one CPU rank, gloo). One test-only stand-in, for what a CPU build of torch lacks:
`specforge.core.loss` (a Triton kernel) replaced by the formula that kernel computes (see `_loss_stand_in`).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

# The tiny target's shapes (the draft takes the same).
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def _loss_stand_in() -> None:
    """`specforge.core.loss` without Triton (which a CPU build of torch lacks): its `LogSoftmaxLoss` computed by the
    formula its Triton kernel implements and is checked against, -sum over the vocabulary of mask * p * log_softmax,
    averaged; autograd takes the backward."""
    import torch

    def compute(logits, target_p, position_mask):
        logp = torch.log_softmax(logits.float(), dim=2)
        return -(position_mask * target_p * logp).sum(2).mean()

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return compute(logits, target_p, position_mask)

    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = LogSoftmaxLoss
    module._compute_loss = compute
    sys.modules["specforge.core.loss"] = module


def build_target(tokenizer: str, out: Path):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = LlamaConfig(vocab_size=len(tok), **SHAPE, num_hidden_layers=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(
        out, max_shard_size="512KB"
    )  # sharded: SpecForge reads the index to find its head
    tok.save_pretrained(out)
    return model


def capture(model, rows: list[dict], features: Path) -> None:
    import torch

    layers = model.config.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4] if layers > 4 else [0, 1, 2]
    group = features / "rows_0-5000"
    group.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for i, row in enumerate(rows):
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            out = model(ids[None, :], output_hidden_states=True)
            hs = out.hidden_states
            torch.save(
                {
                    "input_ids": ids,
                    "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
                    "hidden_state": hs[-1].to(torch.bfloat16),
                    "aux_hidden_state": torch.cat([hs[k + 1] for k in aux], dim=-1).to(
                        torch.bfloat16
                    ),
                },
                group / f"data_{i}.ckpt",
            )


def main(tokens: str, tokenizer: str, workdir: str, steps: str, out: str) -> None:
    work = Path(workdir)
    rows = [json.loads(x) for x in Path(tokens).read_text().splitlines()]
    target = work / "target"
    model = build_target(tokenizer, target)
    capture(model, rows, work / "features")
    vocab = model.config.vocab_size
    del model
    # the draft: one layer over the target's shapes, its vocabulary the target's (no t2d/d2t mapping to build)
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        **SHAPE,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (work / "draft.json").write_text(json.dumps(draft))
    config = {
        "model": {
            "target_model_path": str(target),
            "torch_dtype": "bfloat16",
            "draft_model_config": str(work / "draft.json"),
        },
        "data": {
            "hidden_states_path": str(work / "features"),
            "max_length": 4096,
            "dataloader_num_workers": 0,
        },
        "training": {
            "max_steps": int(steps),
            "batch_size": 1,
            "fsdp_sharding": "NO_SHARD",
            "attention_backend": "sdpa",
            "ttt_length": 2,
            "log_interval": 1,
            "save_interval": 0,
            "learning_rate": 1e-3,
            "warmup_ratio": 0.0,
        },
        "output_dir": str(work / "output"),
    }
    import yaml

    (work / "run.yaml").write_text(yaml.safe_dump(config))
    os.environ.update(
        {
            "SPECFORGE_DEVICE": "cpu",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29517"),
        }
    )
    _loss_stand_in()
    from specforge.cli import main as specforge_main

    specforge_main(["train", "--config", str(work / "run.yaml")])
    Path(out).write_text(
        json.dumps({"rows": len(rows), "features": len(list((work / "features").rglob("*.ckpt")))})
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
