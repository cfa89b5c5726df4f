#!/usr/bin/env python3
"""The BPE half of `flashlm prepare` and `flashlm generate` (the byte-level half is C++ and needs nothing).

  prepare_data.py prepare --vocab-size N --out DIR [--val-fraction F] TEXT...
      Trains a byte-level BPE of N tokens on the texts with the `tokenizers` package (Hugging Face's Rust BPE,
      from PyPI: scripts/setup-tokenizers.sh makes an environment with it), encodes them, and writes
      DIR/train.bin and DIR/val.bin (the last F of the tokens) and DIR/tokenizer.json (the package's own
      format, which flashlm's C++ side decodes). Token files are raw little-endian uint16 (nanoGPT's format)
      when every id fits, that is N <= 65536; otherwise llm.c's LLaMA-3 format (a 256-int32 header: magic
      20240801, version 7, token count; then uint32 tokens). Prints one JSON line saying what it wrote.
  prepare_data.py encode --tokenizer tokenizer.json TEXT
      Prints TEXT's token ids, space-separated: generate's prompt, encoded by the package that trained it.

Why Python: training a BPE and its pre-tokenizer (GPT-2's regular expression, with Unicode classes) are
the `tokenizers` package's job; flashlm calls it rather than keep a second implementation. GPT-2's own
vocabulary through `tiktoken` is not offered: tiktoken's wheel does not carry it (get_encoding("gpt2")
downloads vocab.bpe and encoder.json on first use), and flashlm downloads nothing at run time.
Bad arguments exit 2 and runtime errors 1, each with one `error: ...` line, as the flashlm CLI does.
"""
import argparse
import json
import math
import os
import stat
import struct
import sys
import tempfile
from array import array

MAX_VOCAB = 1 << 20  # far beyond any tokenizer worth training here; bounds the option
MAX_INPUT_BYTES = 4 << 30  # flashlm's kMaxPrepareInputBytes: the corpus is held in memory
LLMC_UINT32_MAGIC, LLMC_UINT32_VERSION = 20240801, 7


class UsageError(Exception):
    pass


def load_tokenizers():
    try:
        import tokenizers  # noqa: F401  (imported for the caller)
    except ImportError:
        raise RuntimeError(
            f"the `tokenizers` package is not importable by {sys.executable}: make an environment with "
            "scripts/setup-tokenizers.sh and point FLASHLM_PYTHON at the python it prints "
            "(or pip install tokenizers)") from None
    import tokenizers
    return tokenizers


def write_together(files):
    """Writes {path: bytes} as one set: every file to a temporary beside it, flushed, and only when all are
    written renamed over their paths, so that a failure (a full disk) leaves the old set whole (as flashlm's
    C++ side writes it, core/file.h)."""
    umask = os.umask(0)
    os.umask(umask)
    tmps = []
    try:
        for path, data in files.items():
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                       prefix=os.path.basename(path) + ".tmp.")
            tmps.append(tmp)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the data from everyone else
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for tmp in tmps:
            os.unlink(tmp)
        raise
    for tmp, path in zip(tmps, files):
        os.replace(tmp, path)


def read_input(path):
    """An input as flashlm's byte path reads it (check_prepare_inputs): a regular file, never a FIFO or a device
    (read without end), of at most MAX_INPUT_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise RuntimeError(f"prepare: '{path}': cannot open: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeError(f"prepare: '{path}': not a regular file")
        if st.st_size > MAX_INPUT_BYTES:
            raise RuntimeError(f"prepare: '{path}' has {st.st_size} bytes, more than the {MAX_INPUT_BYTES} this reads")
        return f.read(st.st_size + 1)


def token_file_bytes(ids, vocab_size):
    if vocab_size <= 1 << 16:
        a = array("H", ids)
        header = b""
    else:
        a = array("I", ids)
        header = struct.pack("<3i", LLMC_UINT32_MAGIC, LLMC_UINT32_VERSION, len(ids)) + bytes(253 * 4)
    if sys.byteorder != "little":
        a.byteswap()
    return header + a.tobytes()


def train_bpe(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes, so that any text encodes
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def prepare(args):
    if not 0 < args.val_fraction <= 0.5 or not math.isfinite(args.val_fraction):
        raise UsageError(f"--val-fraction {args.val_fraction}: expected a number in (0, 0.5]")
    if not 256 <= args.vocab_size <= MAX_VOCAB:
        raise UsageError(f"--vocab-size {args.vocab_size}: expected an integer in [256, {MAX_VOCAB}] (a byte-level "
                         "BPE holds one token per byte before its merges)")
    texts = [read_input(path).decode("utf-8", errors="replace") for path in args.inputs]
    load_tokenizers()
    tok = train_bpe(texts, args.vocab_size)
    ids = [i for enc in tok.encode_batch(texts) for i in enc.ids]
    vocab = tok.get_vocab_size()
    val = math.ceil(args.val_fraction * len(ids))
    if val < 2 or len(ids) - val < 2:
        raise RuntimeError(f"prepare: {len(ids)} tokens in all, {val} of them for validation: each split needs at "
                           "least 2 (give more text or another val_fraction)")
    out = {
        "train": os.path.join(args.out, "train.bin"), "val": os.path.join(args.out, "val.bin"),
        "tokenizer": os.path.join(args.out, "tokenizer.json"),
        "train_tokens": len(ids) - val, "val_tokens": val, "vocab_size": vocab,
        "token_dtype": "uint16" if vocab <= 1 << 16 else "uint32",
    }
    try:
        os.makedirs(args.out, exist_ok=True)
        write_together({out["train"]: token_file_bytes(ids[:-val], vocab),
                        out["val"]: token_file_bytes(ids[-val:], vocab),
                        out["tokenizer"]: tok.to_str().encode("utf-8")})
    except OSError as e:
        raise RuntimeError(f"prepare: cannot write the dataset in '{args.out}': {e.strerror or e}") from None
    print(json.dumps(out))


def encode(args):
    tokenizers = load_tokenizers()
    try:
        tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    except Exception as e:  # the package raises its own exception types for a file it cannot read
        raise RuntimeError(f"tokenizer: '{args.tokenizer}' cannot be read by the tokenizers package: {e}") from None
    try:
        args.text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise UsageError(f"the text to encode is not valid UTF-8 (character {e.start}): a BPE encodes text") from None
    print(" ".join(str(i) for i in tok.encode(args.text).ids))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--val-fraction", type=float, default=0.1)
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("text")
    args = parser.parse_args()  # exits 2 with a usage message on bad arguments
    try:
        prepare(args) if args.command == "prepare" else encode(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
