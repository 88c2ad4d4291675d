"""Token stores (``llmkit data prepare``): tokenizing speed of one worker beside
``tokenizers``' own batch encoding, and resident memory while training batches are drawn
from a store and from one ten times larger.

(a) One ``data prepare`` worker (:class:`~llmkit.data.shards_encode.PieceEncoder` over the
pieces the writer cuts: ids, EOS, lengths and byte counts, long texts in bounded pieces)
against ``tokenizers.Tokenizer.encode_batch`` and ``encode_batch_fast`` (ids taken out of
each encoding, as any caller must), on the same text, the same byte-level BPE, one thread
each (``RAYON_NUM_THREADS=1``, ``TOKENIZERS_PARALLELISM=false``, in a fresh process), rounds
interleaved, best of each. The text is the running Python's standard library sources.
The ratio is asserted ≥ 0.8 against ``encode_batch`` in full mode (``LLMKIT_BENCH=full``);
quick mode (a few MB, timings noisier on shared cores) asserts ≥ 0.7. ``extra_info`` has
the MB/s, tokens/s and the hours one worker per core would take for 10B tokens on N cores.

(b) Peak RSS of a fresh process that opens a store and draws batches (packed and random
windows) from it, for a store and one 10× larger (random ids, written directly): the ratio
of the peaks is asserted < 1.15 (flat). A flat memory-mapped ``TokenFile`` of the larger
corpus is measured beside it for contrast (its mapped pages stay resident).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.conftest import FULL

ROOT = Path(__file__).resolve().parent.parent

SPEED = r"""
import glob, json, sys, sysconfig, time
from pathlib import Path
n_files, vocab, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
texts = [t for t in (Path(f).read_text(errors="ignore") for f in files[:n_files]) if t]
from llmkit.data.shards_encode import PieceEncoder, pieces
from llmkit.data.tokenizer import train_bpe
tok = train_bpe(texts[::7], vocab, show_progress=False)
hf, work = tok.tok, list(pieces(texts))
enc = PieceEncoder(tok.to_str(), tok.eos_id, "uint16")
mb = sum(len(t.encode()) for t in texts) / 1e6
def batch(): return sum(len(e.ids) for e in hf.encode_batch(texts, add_special_tokens=False))
def fast(): return sum(len(e.ids) for e in hf.encode_batch_fast(texts, add_special_tokens=False))
def worker(): return sum(len(enc(p)[0]) for p in work)
best = {}
for _ in range(rounds):
    for name, fn in (("encode_batch", batch), ("encode_batch_fast", fast), ("worker", worker)):
        t = time.perf_counter(); n = fn(); dt = time.perf_counter() - t
        if dt < best.get(name, (1e9, 0))[0]: best[name] = (dt, n)
print(json.dumps({"mb": mb, "best": best}))
"""

RSS = r"""
import json, resource, sys
import numpy as np
from llmkit.data import TokenFile
from llmkit.data.samplers import BlockSampler, RandomWindowSampler
from llmkit.data.shards_open import open_store
path, kind, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = TokenFile(path) if kind == "flat" else open_store(path, "train")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for sampler in (BlockSampler(data, 1024, 0), RandomWindowSampler(data, 1024, 0)):
    for _ in range(batches):
        sampler.next_batch(16)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
print(json.dumps({"before_kib": before, "peak_kib": peak,
                  "rss_file": status["RssFile"].strip(), "rss_anon": status["RssAnon"].strip()}))
"""


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LLMKIT_PLUGINS": "", **(env or {})},
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_worker_tokenizes_as_fast_as_tokenizers(benchmark):
    n_files, vocab, rounds = (1500, 32768, 3) if FULL else (150, 4096, 3)
    env = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = benchmark.pedantic(
        _python, (SPEED, str(n_files), str(vocab), str(rounds)), {"env": env}, rounds=1
    )
    mb, best = out["mb"], out["best"]
    rate = {name: mb / dt for name, (dt, _n) in best.items()}
    tokens_s = best["worker"][1] / best["worker"][0]
    cores = os.cpu_count() or 1
    hours = {f"{n}_cores": round(1e10 / (tokens_s * n) / 3600, 2) for n in (cores, 16, 64)}
    ratio = rate["worker"] / rate["encode_batch"]
    benchmark.extra_info.update(
        {
            "text_mb": round(mb, 2),
            "mb_per_s": {k: round(v, 3) for k, v in rate.items()},
            "worker_tokens_per_s": round(tokens_s),
            "ratio_vs_encode_batch": round(ratio, 3),
            "ratio_vs_encode_batch_fast": round(rate["worker"] / rate["encode_batch_fast"], 3),
            "hours_per_10B_tokens": hours,
        }
    )
    print(json.dumps(benchmark.extra_info))
    assert ratio >= (0.8 if FULL else 0.7), benchmark.extra_info


def _write_store(root: Path, n_tokens: int, shard_tokens: int) -> None:
    """A store of ``n_tokens`` random ids (train and a small validation split), written
    directly: what ``data prepare`` records, without tokenizing."""
    from llmkit.data.shards import file_sha256
    from llmkit.files import write_json_atomic

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, total in (("train", n_tokens), ("validation", 100_000)):
        shards = []
        for k, start in enumerate(range(0, total, shard_tokens)):
            n = min(shard_tokens, total - start)
            path, docs = root / f"{split}-{k:06d}.bin", root / f"{split}-{k:06d}.docs"
            rng.integers(0, 50_000, size=n, dtype=np.uint16).tofile(path)
            np.arange(1000, n + 1, 1000, dtype="<i8").tofile(docs)
            shards.append({
                "file": path.name, "offset": 0, "tokens": n, "documents": n // 1000,
                "n_bytes_text": 4 * n, "max_id": 49_999, "sha256": file_sha256(path),
                "docs": docs.name, "docs_sha256": file_sha256(docs),
            })  # fmt: skip
        splits[split] = {"done": True, "tokens": total, "shards": shards}
    index = {
        "format": "llmkit-token-shards", "version": 1, "complete": True, "layout": "llmkit",
        "dtype": "uint16", "shard_tokens": shard_tokens, "splits": splits, "source": "random",
        "tokenizer": {"sha256": "0" * 64, "vocab_size": 50_257, "eos_id": None},
    }  # fmt: skip
    write_json_atomic(root / "index.json", index)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stores")
    small = 20_000_000 if FULL else 4_000_000
    shard = 10_000_000 if FULL else 1_000_000
    _write_store(tmp / "small", small, shard)
    _write_store(tmp / "large", 10 * small, shard)
    flat = tmp / "large.bin"
    with open(flat, "wb") as f:
        for p in sorted((tmp / "large").glob("train-*.bin")):
            f.write(p.read_bytes())
    return tmp


def test_resident_memory_is_flat_when_the_store_grows_ten_times(benchmark, stores):
    batches = "400" if FULL else "150"
    small = _python(RSS, str(stores / "small"), "store", batches)
    large = benchmark.pedantic(_python, (RSS, str(stores / "large"), "store", batches), rounds=1)
    flat = _python(RSS, str(stores / "large.bin"), "flat", batches)
    ratio = large["peak_kib"] / small["peak_kib"]
    benchmark.extra_info.update(
        {
            "store_peak_mib": round(small["peak_kib"] / 1024, 1),
            "store_10x_peak_mib": round(large["peak_kib"] / 1024, 1),
            "ratio": round(ratio, 3),
            "store_10x_rss_file": large["rss_file"],
            "flat_memmap_10x_peak_mib": round(flat["peak_kib"] / 1024, 1),
            "flat_memmap_10x_rss_file": flat["rss_file"],
        }
    )
    print(json.dumps(benchmark.extra_info))
    assert ratio < 1.15, benchmark.extra_info
