"""Model hyperparameters: the Llama form, and its Mixtral (MoE) form when `moe` is set. With `init_from`
the keys config.json fixes are read from the folder (`trainers.sections.hf_config`, below this module)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from trainers._base import StrictModel
from trainers.storage import Location


class MoEConfig(StrictModel):
    num_experts: PositiveInt = 8
    top_k: PositiveInt = 2
    # None = dropless (every token reaches its k experts); a float = Switch-style capacity
    # tokens_per_expert = ceil(tokens * top_k / num_experts * capacity_factor), overflow dropped.
    capacity_factor: float | None = Field(None, gt=0)
    aux_loss_coef: float = Field(0.01, ge=0)  # Switch Transformer load-balancing loss
    z_loss_coef: float = Field(0.001, ge=0)  # ST-MoE router z-loss
    every: PositiveInt = 1  # an MoE block every k-th block (1 = all blocks, Mixtral)
    # How the experts run (the same math, trainers/models/moe.py): "grouped" = one grouped matmul per
    # projection over the tokens sorted by expert, no host sync; "loop" = one matmul per expert;
    # "auto" = grouped where torch has a grouped-matmul kernel for the device and dtype, else the loop.
    impl: Literal["auto", "loop", "grouped"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; fix: set top_k <= num_experts"
            )
        return self


class ModelConfig(StrictModel):
    vocab_size: PositiveInt = 256
    dim: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt | None = None  # None = n_heads (no grouped-query attention)
    ffn_dim: PositiveInt | None = None  # None = Llama's round_up(2/3 * 4 * dim, multiple_of)
    multiple_of: PositiveInt = 32
    max_seq_len: PositiveInt = 256
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)
    moe: MoEConfig | None = None
    # A Hugging Face Llama/Mixtral folder (config.json + *.safetensors) to start a new run from, local or a
    # bucket URI (s3://bucket/prefix): the keys above that config.json fixes are read from it (a key the
    # YAML also gives must agree). A resume wins.
    init_from: Location = None

    @model_validator(mode="before")
    @classmethod
    def _from_hf(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("init_from") is not None:
            from trainers.sections.hf_config import model_section_from_hf  # reads config.json

            return model_section_from_hf(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.dim % self.n_heads:
            divisors = [h for h in range(1, self.dim + 1) if self.dim % h == 0 and h <= 64]
            raise ValueError(
                f"n_heads={self.n_heads} does not divide dim={self.dim}; fix: use one of {divisors}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head dim {self.dim // self.n_heads} (dim/n_heads) is odd; fix: RoPE needs an even head dim"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; fix: pick a divisor"
            )
        if self.moe is not None and self.moe.every > self.n_layers:
            raise ValueError(
                f"moe.every={self.moe.every} exceeds n_layers={self.n_layers}; fix: set moe.every <= n_layers"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        h = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and (layer_id + 1) % self.moe.every == 0
