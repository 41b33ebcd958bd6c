"""compressed-tensors ``quantization_config``: parse it into per-layer schemes, and write it.

Parsing reads the plain dict with compressed-tensors' field names and defaults, without
importing the library: it pulls in transformers (+4 s of start-up), and checkpoints are
read on every engine start. Writing uses the library's own config classes, so what we
write is what the ecosystem writes. Anything not served is refused with layer, field
and value; nothing is converted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from cache.checkpoint.schemes import FP8_BLOCK, UNQUANTIZED, Activations, LinearScheme, WeightKind
from cache.errors import UnsupportedQuantization

SUPPORTED_METHOD = "compressed-tensors"
SUPPORTED_FORMATS = ("float-quantized",)
SUPPORTED_STATUS = ("compressed", "frozen")
REFUSED_KEYS = ("kv_cache_scheme", "sparsity_config", "transform_config")

# (weights strategy) -> {(activation strategy, dynamic): Activations}
ACTIVATIONS_FOR: dict[str, dict[tuple[str, bool], Activations]] = {
    "block": {("group", True): Activations.DYNAMIC_GROUP},
    "channel": {("token", True): Activations.DYNAMIC_TOKEN},
    "tensor": {("token", True): Activations.DYNAMIC_TOKEN, ("tensor", False): Activations.STATIC_TENSOR},
}
WEIGHT_KIND = {"block": WeightKind.FP8_BLOCK, "channel": WeightKind.FP8_CHANNEL, "tensor": WeightKind.FP8_TENSOR}
SUPPORTED_SUMMARY = (
    "FP8 e4m3 symmetric weights per tensor, per channel or in 128x128 blocks, with dynamic "
    "per-token (tensor/channel), dynamic per-token-group-128 (block) or static per-tensor (tensor) activations"
)


def parse_schemes(qc: dict[str, Any] | None, linear_names: Iterable[str]) -> dict[str, LinearScheme]:
    """Map every Linear module name to its scheme; raise UnsupportedQuantization on anything else."""
    names = list(linear_names)
    schemes = dict.fromkeys(names, UNQUANTIZED)
    if not qc:
        return schemes
    where = "quantization_config"
    method = qc.get("quant_method")
    if method != SUPPORTED_METHOD:
        raise UnsupportedQuantization(layer=where, field="quant_method", value=method, supported=[SUPPORTED_METHOD])
    for key in REFUSED_KEYS:
        if qc.get(key):
            raise UnsupportedQuantization(layer=where, field=key, value=qc[key], supported="none")
    status = qc.get("quantization_status", "compressed")
    if status not in SUPPORTED_STATUS:
        raise UnsupportedQuantization(
            layer=where, field="quantization_status", value=status, supported=SUPPORTED_STATUS
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedQuantization(layer=where, field="config_groups", value=groups, supported="a non-empty mapping")
    ignore = qc.get("ignore") or []

    claimed: dict[str, str] = {}
    for group_name, group in groups.items():
        gwhere = f"{where}.config_groups.{group_name}"
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(targets, list) or not targets:
            raise UnsupportedQuantization(layer=gwhere, field="targets", value=targets, supported="a list of targets")
        for target in targets:
            if not target.startswith("re:") and target != "Linear" and target not in names:
                raise UnsupportedQuantization(
                    layer=gwhere, field="targets", value=target,
                    supported="'Linear', 're:<regex>' or a Linear module name",
                )  # fmt: skip
        matched = [n for n in names if _matches(n, targets) and not _matches(n, ignore)]
        fmt = group.get("format") or qc.get("format")
        for name in matched:
            if name in claimed:
                raise UnsupportedQuantization(
                    layer=name,
                    field="config_groups",
                    value=[claimed[name], group_name],
                    supported="one group per layer",
                )
            claimed[name] = group_name
            schemes[name] = scheme_for(group, fmt, layer=name)
    return schemes


def scheme_for(group: dict[str, Any], fmt: str | None, *, layer: str) -> LinearScheme:
    """The LinearScheme for one layer's quantization group, or the first unsupported field."""

    def refuse(field: str, value: Any, supported: Any) -> UnsupportedQuantization:
        return UnsupportedQuantization(layer=layer, field=field, value=value, supported=supported)

    w = group.get("weights")
    if not w:
        raise refuse("weights", None, SUPPORTED_SUMMARY)
    _check_fp8_args(w, "weights", refuse)
    if fmt not in SUPPORTED_FORMATS:
        raise refuse("format", fmt, SUPPORTED_FORMATS)
    w_strategy = _strategy(w)
    if w_strategy not in WEIGHT_KIND:
        raise refuse("weights.strategy", w_strategy, list(WEIGHT_KIND))
    if w.get("dynamic", False) is not False:
        raise refuse("weights.dynamic", w.get("dynamic"), [False])
    if w_strategy == "block" and _block(w.get("block_structure")) != [FP8_BLOCK, FP8_BLOCK]:
        raise refuse("weights.block_structure", w.get("block_structure"), [[FP8_BLOCK, FP8_BLOCK]])

    a = group.get("input_activations")
    if not a:
        raise refuse("input_activations", None, "FP8 W8A8 (weight-only FP8 is not served)")
    _check_fp8_args(a, "input_activations", refuse)
    a_strategy, a_dynamic = _strategy(a), a.get("dynamic", False)
    allowed = ACTIVATIONS_FOR[w_strategy]
    if (a_strategy, a_dynamic) not in allowed:
        kind = "dynamic" if a_dynamic else "static"
        raise refuse(
            "input_activations.strategy",
            f"{kind} per-{a_strategy}",
            [f"{'dynamic' if d else 'static'} per-{s}" for s, d in allowed],
        )
    if w_strategy == "block" and a.get("group_size") != FP8_BLOCK:
        raise refuse("input_activations.group_size", a.get("group_size"), [FP8_BLOCK])
    if group.get("output_activations"):
        raise refuse("output_activations", "set", "none")
    return LinearScheme(WEIGHT_KIND[w_strategy], allowed[(a_strategy, a_dynamic)])


def _check_fp8_args(args: dict[str, Any], prefix: str, refuse: Any) -> None:
    # compressed-tensors defaults: type "int", num_bits 8, symmetric True.
    if args.get("num_bits", 8) != 8:
        raise refuse(f"{prefix}.num_bits", args.get("num_bits"), [8])
    qtype = args.get("type", "int")
    if qtype != "float":
        raise refuse(f"{prefix}.type", qtype, ["float"])
    if args.get("symmetric", True) is not True:
        raise refuse(f"{prefix}.symmetric", args.get("symmetric"), [True])


def _strategy(args: dict[str, Any]) -> str:
    """The strategy, inferred as compressed-tensors does when the field is absent."""
    strategy = args.get("strategy")
    if strategy:
        return str(strategy)
    group_size = args.get("group_size")
    if group_size is None:
        return "tensor"
    return "channel" if group_size == -1 else "group"


def _block(value: Any) -> list[int] | Any:
    if isinstance(value, str) and "x" in value:  # older writers: "128x128"
        try:
            return [int(v) for v in value.split("x")]
        except ValueError:
            return value
    return list(value) if isinstance(value, (list, tuple)) else value


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        if p in ("Linear", name):
            return True
        if p.startswith("re:") and re.match(p[3:], name):
            return True
    return False


def write_config(scheme: LinearScheme, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` for checkpoints warmgate writes, built with compressed-tensors' classes."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    w_strategy = {v: k for k, v in WEIGHT_KIND.items()}[scheme.weight]
    weights = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, dynamic=False, strategy=w_strategy,
        block_structure=[FP8_BLOCK, FP8_BLOCK] if w_strategy == "block" else None,
    )  # fmt: skip
    if scheme.activations is Activations.DYNAMIC_GROUP:
        acts = QuantizationArgs(
            num_bits=8, type="float", symmetric=True, dynamic=True, strategy="group", group_size=FP8_BLOCK
        )
    elif scheme.activations is Activations.DYNAMIC_TOKEN:
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")
    else:
        raise ValueError(f"warmgate writes dynamic activations only, not {scheme.activations}")
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)},
        format=SUPPORTED_FORMATS[0],
        quantization_status="compressed",
        ignore=ignore,
    )
    return config.model_dump(mode="json")
