"""GGUF as an input format: a `.gguf` file becomes a Hugging Face model folder that every
part of the cluster loads as usual (the engine its weights, the torch-free router its
tokenizer and chat template).

    convert_gguf("m.gguf", "out/m")   # dequantize to float32 safetensors + tokenizer + config
    resolve_model("m.gguf")           # -> "<cache>/gguf/<sha256[:16]>/m": converted once
    resolve_model("some/folder")      # -> "some/folder", untouched

The `gguf` package reads the file's header first, so a corrupt file (`GGUFError`) or an
architecture the engine has no model for (`UnsupportedGGUFArchitecture`, naming it) fails
before any weights are read. transformers then dequantizes the tensors and rebuilds the
tokenizer (with its chat template) from the file's metadata. The folder is written next to
its final place and renamed into it, so a half-written conversion never counts as done.

The cache is keyed by the file's SHA-256: a changed file converts again. It lives under
`core.paths.cache_dir()` ($PDCLUSTER_CACHE_DIR, else ~/.cache/pdcluster).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from pdcluster.core import paths

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` values the engine has a model for (engine/models/llama.py).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")


class GGUFError(ValueError):
    """The file is not a GGUF model pdcluster can read (missing, corrupt, truncated)."""


class UnsupportedGGUFArchitecture(GGUFError):
    """The GGUF holds a model architecture the engine does not implement."""

    def __init__(self, path: str | Path, architecture: str) -> None:
        super().__init__(
            f"{path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
        self.architecture = architecture


def is_gguf(path: str | Path) -> bool:
    """True for an existing file that starts with the GGUF magic or is named *.gguf."""
    file = Path(path)
    if not file.is_file():
        return False
    if file.suffix.lower() == ".gguf":
        return True
    with file.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_architecture(path: str | Path) -> str:
    """The file's `general.architecture`, read from its header; GGUFError when unreadable."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        architecture = field.contents() if field is not None else None
    except Exception as exc:  # the reader raises ValueError, struct/numpy errors, ...
        raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"
                        ) from exc
    if not isinstance(architecture, str):
        raise GGUFError(f"{path}: GGUF file has no general.architecture")
    return architecture


def check_gguf(path: str | Path) -> str:
    """Validate the header and the architecture; returns the architecture."""
    if not Path(path).is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    architecture = gguf_architecture(path)
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedGGUFArchitecture(path, architecture)
    return architecture


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(model: str | Path, cache_dir: str | Path | None = None) -> str:
    """A model folder as given; a GGUF file as its converted folder (converting it once)."""
    if not is_gguf(model):
        return str(model)
    check_gguf(model)
    root = Path(cache_dir) if cache_dir is not None else paths.cache_dir()
    out = root / "gguf" / file_sha256(model)[:16] / Path(model).stem
    if (out / "config.json").is_file():
        return str(out)
    logger.info("converting %s to %s", model, out)
    try:
        return str(convert_gguf(model, out))
    except OSError:
        if (out / "config.json").is_file():  # another process converted it meanwhile
            return str(out)
        raise


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Write a float32 HF folder (safetensors, config, generation config, tokenizer with its
    chat template) for the GGUF at `path` into `out_dir`, which must not exist yet."""
    path, out = Path(path), Path(out_dir)
    check_gguf(path)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_hf_folder(path, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the folder is a shared cache
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_hf_folder(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise GGUFError(f"{path}: transformers could not load this GGUF "
                        f"({type(exc).__name__}: {exc})") from exc
    # The tensors are already dequantized to float32; only the marker is left, and
    # save_pretrained refuses a model that carries it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
