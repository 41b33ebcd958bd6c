"""Per-request sampling settings, as the OpenAI API names them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.grammar import Grammar

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's top_logprobs limit)
LOGPROB_FLOOR = -9999.0  # reported for a token the sampler could not pick (cut by top-k or top-p), as vLLM does


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's eos
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's logprob and this many most likely alternatives (None: none)
    grammar: Grammar | None = None  # the answer is held to it (structured outputs), compiled by the server
    prompt_logprobs: int | None = None  # also each prompt token's logprob and its alternatives (echo)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be at least 0 (0: the prompt is only scored, with echo)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def check_request(prompt_ids: list[int], params: SamplingParams, max_model_len: int,
                  output_ids: list[int] | None = None) -> None:  # fmt: skip
    """ValueError unless an engine can take this request: a prompt, room for max_tokens in the context, and (for a
    resume, ``output_ids`` already generated) tokens still to generate."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len ({max_model_len})")  # fmt: skip
    if output_ids and len(output_ids) >= params.max_tokens:
        raise ValueError(f"the request already has {len(output_ids)} of its {params.max_tokens} tokens")
