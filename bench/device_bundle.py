"""What a GPU device call carries: the serving packages its image lacks, the demo tokenizer, DeepGEMM's source.

    python bench/device_bundle.py                                  # .whl/ and .gputok/
    python bench/device_bundle.py --deep-gemm DIR --cutlass DIR    # and .dg/pinned.tgz (DIR: git clones, bare is fine)
    python bench/device_bundle.py --check                          # only: is every dependency placed? (CI runs it)

The device machine (docs/benchmarks.md) has torch, Triton and CUDA but no network and none of the gateway's own
packages; a call carries ignored folders of this checkout (`carry: [".whl", ".gputok", ".dg"]`), and
`bench/gpu_serving.sh setup` installs them. Everything is built from this venv, so the device runs the versions CI
tests, with the image's torch, Triton and numpy:

  .whl/            CPython 3.12 x86-64 wheels of the packages the image lacks, installed over it
  .whl/opt/        packages the image may have: installed where it lacks one or has a version pyproject refuses
  .gputok/         the demo checkpoint's tokenizer (`model synth --tokenizer .gputok`: text for synthetic models)
  .dg/pinned.tgz   DeepGEMM's Python JIT package at pyproject's pinned commit, CUTLASS's headers in its include/

Every package warmgate needs at run time (its dependency closure in this venv, with the `cuda` extra) is in exactly one
of CARRIED, WHERE_NEEDED and IMAGE; a new dependency stops this script until it is placed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The device's Python (torch 2.11 + CUDA 13 image) and the platforms its wheels may be built for.
PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]
# Missing from the image (checked there on 2026-11-29 .. 12-06), or carried at our version since the gateway needs it
# (typing-extensions and anyio for pydantic and starlette, uvloop and prometheus-client for the relays).
CARRIED = {
    "annotated-doc", "annotated-types", "anyio", "compressed-tensors", "fastapi", "httptools", "loguru",
    "opentelemetry-api", "platformdirs", "prometheus-client", "pydantic", "pydantic-core", "pydantic-settings",
    "python-dotenv", "setproctitle", "starlette", "typing-extensions", "typing-inspection", "uvicorn", "uvloop",
}  # fmt: skip
# On the image in some version: xgrammar's (tvm-ffi) and the tokenizer's (tokenizers: DecodeStream came in 0.21).
WHERE_NEEDED = {
    "apache-tvm-ffi", "hf-xet", "httpcore2", "httpx2", "huggingface-hub", "kernels", "tokenizers", "tomlkit",
    "transformers", "truststore", "xgrammar",
}  # fmt: skip
# The image's own: torch and what it is built with, and general packages in any recent version. gguf only reads the
# demo's GGUF (never on the device).
IMAGE = {
    "accelerate", "certifi", "charset-normalizer", "click", "cuda-bindings", "filelock", "fsspec", "gguf", "h11",
    "httpcore", "httpx", "idna", "jinja2", "markdown-it-py", "markupsafe", "mdurl", "mpmath", "networkx", "numpy",
    "packaging", "psutil", "pygments", "pyyaml", "regex", "requests", "rich", "safetensors", "setuptools",
    "shellingham", "sympy", "tabulate", "torch", "tqdm", "triton", "typer", "urllib3",
}  # fmt: skip


def closure(root: str = "warmgate", extras: tuple[str, ...] = ("cuda",)) -> dict[str, str | None]:
    """Every distribution ``root`` needs on the device's Python, with its version here (None: not installed here)."""
    env: dict[str, str] = {key: str(value) for key, value in default_environment().items()}
    env |= {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0"}
    found: dict[str, str | None] = {}

    def walk(name: str, extras: tuple[str, ...]) -> None:
        key = canonicalize_name(name)
        if key in found:
            return
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            found[key] = None
            return
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras or ("",)):
                continue
            walk(req.name, tuple(req.extras))

    walk(root, extras)
    found.pop(root)
    return found


def check_placed(needed: dict[str, str | None]) -> None:
    """Exit naming any dependency that is in none, or more than one, of the three lists."""
    unplaced = sorted(set(needed) - CARRIED - WHERE_NEEDED - IMAGE)
    if unplaced:
        sys.exit(f"place these in CARRIED, WHERE_NEEDED or IMAGE first: {', '.join(unplaced)}")
    twice = sorted((CARRIED & WHERE_NEEDED) | (CARRIED & IMAGE) | (WHERE_NEEDED & IMAGE))
    if twice:
        sys.exit(f"in more than one of CARRIED, WHERE_NEEDED and IMAGE: {', '.join(twice)}")


def wheels(out: Path, needed: dict[str, str | None]) -> None:
    for folder, names in ((out / ".whl", CARRIED), (out / ".whl" / "opt", WHERE_NEEDED)):
        missing = sorted(n for n in names if needed.get(n) is None and n in needed)
        if missing:
            sys.exit(f"not installed in this venv (run `make setup`): {', '.join(missing)}")
        pins = [f"{n}=={needed[n]}" for n in sorted(names) if n in needed]
        for old in folder.glob("*.whl"):  # two versions of one package stop the install there
            old.unlink()
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(folder), *pins],
                       check=True)  # fmt: skip
        print(f"{folder.relative_to(out)}: {len(pins)} wheels, {size_mb(folder, '*.whl'):.1f} MB")


def tokenizer(out: Path) -> None:
    from cache.checkpoint import demo
    from cache.checkpoint.writer import copy_tokenizer

    target = out / ".gputok"
    target.mkdir(exist_ok=True)
    copied = copy_tokenizer(demo.build_demo("bf16", progress=False), target)
    print(f".gputok: {', '.join(copied)}, {size_mb(target, '*'):.1f} MB")


def deep_gemm(out: Path, deep_gemm_git: Path, cutlass_git: Path) -> None:
    """DeepGEMM's package as its setup.py lays it out, from the commit pyproject pins and CUTLASS at its submodule's."""
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deepgemm"][0]
    commit = pinned.rsplit("@", 1)[1]
    tree = git(deep_gemm_git, "ls-tree", commit, "third-party/cutlass").split()
    cutlass_commit = tree[2]  # a submodule's entry: mode, "commit", its commit
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        extract(git_archive(deep_gemm_git, commit, "deep_gemm"), stage)
        extract(git_archive(cutlass_git, cutlass_commit, "include/cute", "include/cutlass"), stage / "cutlass")
        for part in ("cute", "cutlass"):
            shutil.move(stage / "cutlass" / "include" / part, stage / "deep_gemm" / "include" / part)
        (out / ".dg").mkdir(exist_ok=True)
        with tarfile.open(out / ".dg" / "pinned.tgz", "w:gz") as tar:
            tar.add(stage / "deep_gemm", arcname="deep_gemm")
    size = size_mb(out / ".dg", "*.tgz")
    print(f".dg/pinned.tgz: DeepGEMM {commit[:7]}, CUTLASS {cutlass_commit[:7]}, {size:.1f} MB")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def git_archive(repo: Path, commit: str, *paths: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit, *paths],
                          check=True, capture_output=True).stdout  # fmt: skip


def extract(archive: bytes, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def size_mb(folder: Path, pattern: str) -> float:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="the checkout whose ignored folders to fill")
    parser.add_argument("--deep-gemm", type=Path, help="a git clone of deepseek-ai/DeepGEMM")
    parser.add_argument("--cutlass", type=Path, help="a git clone of NVIDIA/cutlass")
    parser.add_argument("--check", action="store_true", help="only check that every dependency is placed")
    args = parser.parse_args()
    if (args.deep_gemm is None) != (args.cutlass is None):
        parser.error("--deep-gemm and --cutlass go together")
    needed = closure()
    check_placed(needed)
    if args.check:
        print(f"all {len(needed)} dependencies placed")
        return
    wheels(args.out, needed)
    tokenizer(args.out)
    if args.deep_gemm:
        deep_gemm(args.out, args.deep_gemm, args.cutlass)
    total = sum(size_mb(args.out / folder, "*") for folder in (".whl", ".gputok", ".dg"))
    print(f"together {total:.1f} MB, of the 64 MiB a device call carries with the checkout")


if __name__ == "__main__":
    main()
