"""The example tokenizer, `examples/tokenizer.json`: a byte-level BPE of 512 tokens (256 bytes,
`<|endoftext|>` and 255 merges) trained with Hugging Face `tokenizers` on this repository's
Markdown files. Use it, or one of yours, with `data=hf data.tokenizer=examples/tokenizer.json`.

    python examples/train_tokenizer.py [--vocab 512] [--out examples/tokenizer.json] [FILES...]
"""

from __future__ import annotations

import argparse
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="text files (default: README.md, docs/*.md)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(ROOT, "examples", "tokenizer.json"))
    args = parser.parse_args()
    files = args.files or [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    tokenizer.save(args.out)
    print(f"{args.out}: {tokenizer.get_vocab_size()} tokens from {len(files)} files")


if __name__ == "__main__":
    main()
