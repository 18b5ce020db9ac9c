"""Text corpus -> token ids -> batches, with no downloads and no hidden state.

The default corpus is the top-level ``*.py`` modules of the running Python's standard library:
every machine that can run the trainer has it (about 4.7 MB of text for Python 3.11).
Each document is split at 90% of its length: the head goes to training, the tail to validation,
so both splits are non-empty and the split never depends on the seed.

Batches are a pure function of ``(seed, rank, step)``: a resumed run draws exactly the batches
the uninterrupted run would have drawn, without saving any sampler state.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import torch

VAL_FRACTION = 0.1
BYTE_VOCAB_SIZE = 256


def default_corpus_files() -> List[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def corpus_files(data: Optional[str]) -> List[Path]:
    """The documents of ``--data``: a file, or every file under a folder (sorted, hidden ones skipped)."""
    if data is None:
        return default_corpus_files()
    path = Path(data)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"--data folder {data!r} contains no files")
        return files
    raise ValueError(f"--data must be a text file or a folder of text files, {data!r} does not exist")


class ByteTokenizer:
    """Every UTF-8 byte is a token: vocabulary of 256, nothing to download."""
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class LocalTokenizer:
    """A tokenizer saved on disk (a folder ``AutoTokenizer.from_pretrained`` can read), never fetched."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ValueError(f"--tokenizer must be a local tokenizer folder, {path!r} is not a folder")
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._tok.encode(text, add_special_tokens=False), dtype=torch.long)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def make_tokenizer(path: Optional[str]):
    return ByteTokenizer() if path is None else LocalTokenizer(path)


def load_splits(data: Optional[str], tokenizer) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the train and validation splits as 1-D int64 tensors."""
    train: List[torch.Tensor] = []
    val: List[torch.Tensor] = []
    for f in corpus_files(data):
        text = f.read_bytes().decode("utf-8", errors="replace")
        if not text:
            continue
        cut = int(len(text) * (1.0 - VAL_FRACTION))
        train.append(tokenizer.encode(text[:cut]))
        val.append(tokenizer.encode(text[cut:]))
    if not train:
        raise ValueError(f"--data {data!r}: every file is empty")
    return torch.cat(train), torch.cat(val)


def check_length(split: str, tokens: torch.Tensor, context: int) -> None:
    if tokens.numel() <= context + 1:
        raise ValueError(f"the {split} split has {tokens.numel()} tokens; it needs more than the context "
                         f"length {context} + 1 (use more text or a smaller --context)")


def _generator(seed: int, stream: int, rank: int, step: int) -> torch.Generator:
    g = torch.Generator()
    # Distinct large odd multipliers keep the (seed, stream, rank, step) tuples from colliding.
    g.manual_seed((seed * 1_000_003 + stream * 7_919 + rank * 104_729 + step * 15_485_863) % (2 ** 63))
    return g


def get_batch(tokens: torch.Tensor, batch_size: int, context: int, seed: int, rank: int,
              step: int, stream: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``context`` tokens and their next-token targets."""
    g = _generator(seed, stream, rank, step)
    starts = torch.randint(0, tokens.numel() - context - 1, (batch_size,), generator=g)
    x = torch.stack([tokens[s:s + context] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + context] for s in starts.tolist()])
    return x, y
