"""nanoGPT's ``data/shakespeare_char`` files made from a local corpus, without a download.

nanoGPT's ``train.py`` reads ``data/<dataset>/train.bin`` and ``val.bin`` (token ids, uint16)
and ``meta.pkl`` (``vocab_size``, ``itos``, ``stoi``). Its own ``prepare.py`` downloads
tinyshakespeare first; the device machine reaches no network, so this writes the same files
from a corpus on disk, the way nanoGPT's ``data/shakespeare_char/readme.md`` documents them:
the vocabulary is the corpus's sorted distinct characters, ids are their positions, the first
90 % of the characters is the training split and the rest validation.

    python -m benchmarks.scripts.nanogpt_data CORPUS NANOGPT_DIR [--dataset shakespeare_char]

Files already holding the same bytes are left alone (their modification times too).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import numpy as np

DATASET = "shakespeare_char"
TRAIN_FRACTION = 0.9


def encode(text: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train ids, validation ids, meta) of ``text`` as nanoGPT makes them."""
    chars = sorted(set(text))
    if len(chars) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"{len(chars)} distinct characters do not fit uint16 ids")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = dict(enumerate(chars))
    table = np.zeros(max(map(ord, chars)) + 1, dtype=np.uint16)
    table[[ord(c) for c in chars]] = np.arange(len(chars), dtype=np.uint16)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = table[codes]
    cut = int(len(text) * TRAIN_FRACTION)
    return ids[:cut], ids[cut:], {"vocab_size": len(chars), "itos": itos, "stoi": stoi}


def _write(path: Path, data: bytes) -> bool:
    """Write ``data`` unless the file holds it already; True when written."""
    if path.is_file() and path.read_bytes() == data:
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return True


def prepare(corpus: str | Path, nanogpt: str | Path, dataset: str = DATASET) -> dict:
    """Write ``train.bin``, ``val.bin`` and ``meta.pkl`` under ``nanogpt/data/<dataset>``;
    returns what was made (token counts, vocabulary size, the directory)."""
    text = Path(corpus).read_text(encoding="utf-8")
    train, val, meta = encode(text)
    out = Path(nanogpt) / "data" / dataset
    out.mkdir(parents=True, exist_ok=True)
    written = [
        name
        for name, data in (
            ("train.bin", train.tobytes()),
            ("val.bin", val.tobytes()),
            ("meta.pkl", pickle.dumps(meta)),
        )
        if _write(out / name, data)
    ]
    return {"dir": str(out), "train_tokens": len(train), "val_tokens": len(val),
            "vocab_size": meta["vocab_size"], "written": written}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", help="a UTF-8 text file (tinyshakespeare)")
    ap.add_argument("nanogpt", help="nanoGPT's checkout (the folder holding train.py)")
    ap.add_argument("--dataset", default=DATASET, help=f"data/<dataset> (default {DATASET})")
    args = ap.parse_args(argv)
    info = prepare(args.corpus, args.nanogpt, args.dataset)
    print(
        f"{info['dir']}: train {info['train_tokens']:,} / val {info['val_tokens']:,} tokens, "
        f"vocab {info['vocab_size']} ({', '.join(info['written']) or 'unchanged'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
