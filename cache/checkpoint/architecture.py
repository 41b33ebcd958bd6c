"""Which tensors a Llama-family checkpoint must hold, and their shapes, from config.json alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache.errors import CheckpointError, UnsupportedArchitecture

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

ATTENTION_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")

# Buffers some exporters save that carry no weights; ignored when present.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(
                f"model_type={model_type!r} is not supported",
                layer="config.json",
                field="model_type",
                value=model_type,
                supported=SUPPORTED_MODEL_TYPES,
            )
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            return cls(
                model_type=model_type,
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; the others say so in config.
                attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
            )
        except KeyError as missing:
            raise CheckpointError(
                f"config.json lacks {missing.args[0]!r}", layer="config.json", field=str(missing.args[0])
            ) from None


@dataclass
class ModelLayout:
    """Every tensor name the checkpoint must hold, split into Linear layers and the rest."""

    shape: ModelShape
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> (N, K)
    others: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor -> shape
    optional: set[str] = field(default_factory=set)  # tensors that may be absent

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelLayout:
        s = ModelShape.from_config(config)
        layout = cls(shape=s)
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        layout.others["model.embed_tokens.weight"] = (s.vocab, s.hidden)
        layout.others["model.norm.weight"] = (s.hidden,)
        for i in range(s.layers):
            p = f"model.layers.{i}"
            layout.others[f"{p}.input_layernorm.weight"] = (s.hidden,)
            layout.others[f"{p}.post_attention_layernorm.weight"] = (s.hidden,)
            dims = {
                "self_attn.q_proj": (q, s.hidden),
                "self_attn.k_proj": (kv, s.hidden),
                "self_attn.v_proj": (kv, s.hidden),
                "self_attn.o_proj": (s.hidden, q),
                "mlp.gate_proj": (s.intermediate, s.hidden),
                "mlp.up_proj": (s.intermediate, s.hidden),
                "mlp.down_proj": (s.hidden, s.intermediate),
            }
            for name, nk in dims.items():
                layout.linears[f"{p}.{name}"] = nk
                biased = s.attention_bias if name.startswith("self_attn") else s.mlp_bias
                # Llama's attention_bias covers o_proj too; Qwen2 biases only q/k/v.
                if biased and not (s.model_type == "qwen2" and name == "self_attn.o_proj"):
                    layout.others[f"{p}.{name}.bias"] = (nk[0],)
            if s.qk_norm:
                layout.others[f"{p}.self_attn.q_norm.weight"] = (s.head_dim,)
                layout.others[f"{p}.self_attn.k_norm.weight"] = (s.head_dim,)
        if s.tied_embeddings:
            # Tied: lm_head is the embedding; some exporters still write a copy.
            layout.others["lm_head.weight"] = (s.vocab, s.hidden)
            layout.optional.add("lm_head.weight")
        else:
            layout.linears["lm_head"] = (s.vocab, s.hidden)
        return layout

    @staticmethod
    def ignored(name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES)
