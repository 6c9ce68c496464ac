"""Offline training data: a jsonl text corpus from the installed Python standard library and a
byte-level BPE tokenizer trained on it, written where the train configs look for them.

    python -m torchtitan_ext.data [--out data/stdlib] [--vocab-size 2048] [--force]

The folder then holds ``corpus/stdlib.jsonl`` (``{"text": ...}`` records: the ``*.py`` files cut at line
ends into pieces of about 2,000 characters, shuffled with a fixed seed so that consecutive batches
are alike; the same Python version gives the same corpus on every machine) and
``tokenizer/tokenizer.json`` + ``tokenizer/tokenizer_config.json`` (bos/eos tokens). The configs
load the corpus through torchtitan's ``c4_test`` loader (``--training.dataset_path``) and the
tokenizer through ``--model.hf_assets_path``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

DEFAULT_OUT = Path("data/stdlib")
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
PIECE_CHARS = 2000
SHUFFLE_SEED = 0
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def corpus_dir(out: Path) -> Path:
    """Folder of the jsonl dataset (the value for ``--training.dataset_path``)."""
    return out / "corpus"


def tokenizer_dir(out: Path) -> Path:
    """Folder of the tokenizer files (the value for ``--model.hf_assets_path``)."""
    return out / "tokenizer"


def is_built(out: Path) -> bool:
    """True when both the corpus and the tokenizer exist under ``out``."""
    return (corpus_dir(out) / "stdlib.jsonl").is_file() and (tokenizer_dir(out) / "tokenizer.json").is_file()


def stdlib_sources(root: Path | None = None) -> Iterator[str]:
    """Texts of the standard library's ``*.py`` files (tests and third-party packages left out), sorted by path."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield text


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut at line ends into consecutive pieces of about ``size`` characters (none empty)."""
    out, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            out.append("".join(current))
            current, length = [], 0
    if current:
        out.append("".join(current))
    return out


def write_corpus(out: Path, root: Path | None = None) -> Path:
    """Write ``stdlib.jsonl`` (from ``root``, default the standard library) under ``corpus_dir(out)``; return it."""
    records = [piece for text in stdlib_sources(root) for piece in pieces(text)]
    random.Random(SHUFFLE_SEED).shuffle(records)
    folder = corpus_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "stdlib.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({"text": record}) + "\n")
    return path


def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> Path:
    """Train a byte-level BPE tokenizer on the corpus; save it with a config naming bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        with corpus.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    folder = tokenizer_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def build(out: Path = DEFAULT_OUT, vocab_size: int = 2048, force: bool = False, root: Path | None = None) -> Path:
    """Build corpus (from ``root``, default the standard library) and tokenizer under ``out`` unless they
    exist (or ``force``); return ``out``.

    The files are written to a private temporary folder that is then renamed to ``out``, so
    processes that start together (torchrun ranks) never read a half-written folder.
    """
    if is_built(out) and not force:
        return out
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    train_tokenizer(write_corpus(tmp, root), tmp, vocab_size)
    if force and out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(tmp)
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--force", action="store_true", help="rebuild even when the files exist")
    args = parser.parse_args(argv)
    out = build(args.out, args.vocab_size, args.force)
    corpus = corpus_dir(out) / "stdlib.jsonl"
    print(
        f"corpus: {corpus} ({corpus.stat().st_size / 2**20:.1f} MiB); tokenizer: {tokenizer_dir(out)}", file=sys.stderr
    )


if __name__ == "__main__":
    main()
