"""Make the small Llama-form model that examples/finetune-pbt.yaml fine-tunes, with transformers.

It stands in for a pretrained checkpoint (nothing is downloaded: the weights are transformers' own seeded
random init): LlamaForCausalLM in tiny-dense.yaml's shape, saved by `save_pretrained` (config.json +
model.safetensors), with the byte-level tokenizer as tokenizer.json, so that

    raytrain data prepare --tokenizer models/tiny-llama --output data/stdlib-tiny-llama

tokenizes the fine-tuning text with it. A real fine-tune points model.init_from at a real model's folder.
Needs the `hf` extra (pip install raytrain-ext[hf]).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def make(output: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.data.tokenizer import ByteTokenizer, save_hf

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=257,  # the byte tokenizer: 256 bytes + end-of-document
        hidden_size=128,
        intermediate_size=352,  # our default SwiGLU width for dim 128
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=ByteTokenizer.eos_id,
        pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(output)
    save_hf(ByteTokenizer(), output, config.max_position_embeddings)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="models/tiny-llama", help="folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {make(Path(args.output), args.seed)}")


if __name__ == "__main__":
    main()
