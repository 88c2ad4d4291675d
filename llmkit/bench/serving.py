"""Measuring the server (``llmkit bench serve``): throughput and latency of
``requests`` streamed completions sent by ``concurrency`` clients at once, against the same
requests generated one after another by ``llmkit generate``'s code (:class:`Generator`).

Every request is greedy with EOS ignored, so each yields exactly ``max_tokens`` tokens, from
a prompt of ``prompt_len`` tokens cut from the standard library's sources. Figures:

- ``tokens_per_s``: completion tokens of all requests / the time from the first request
  sent to the last token received; ``sequential_tokens_per_s``: the same tokens / the
  summed time of generating each request alone (the decoding layout ``llmkit generate``
  uses for one row), on ``sequential`` of the requests; ``speedup``: their ratio;
- ``ttft_*``: time to first token, from sending a request to receiving its first token
  (server-sent event), so it includes the time queued behind other requests; p50 and p99;
- ``itl_*``: per-token latency, the gaps between a request's successive tokens; p50, p99;
- ``latency_p50_s``: a whole request; ``peak_batch``: the most choices one decoding step
  held.

A spec file is served with random weights and a byte-level BPE tokenizer trained here on
about 2 MB of the standard library (its vocabulary may be smaller than the model's: ids
beyond it decode to nothing, so such tokens cost no text).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmkit.errors import LlmkitError


def _corpus_text(limit: int = 2_000_000) -> str:
    """About ``limit`` characters of the standard library's top-level modules."""
    import sysconfig

    parts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= limit:
            break
    return "\n".join(parts)


def _load(
    source: str | Path, weights: str, device: torch.device, dtype: str
) -> tuple[Any, Any, str, int]:
    """(model, tokenizer, name, parameters): a run's, or a spec file's shape with random
    weights and a tokenizer trained on the standard library."""
    path = Path(source)
    if path.is_file():
        from llmkit.data.tokenizer import train_bpe
        from llmkit.model import build_model
        from llmkit.spec import load_spec

        rs = load_spec(path, [])
        torch.manual_seed(0)
        model = build_model(rs).to(device).eval()
        params = sum(p.numel() for p in model.parameters())
        if dtype and dtype != "float32":
            from llmkit.inference.quantize import quantize_model

            model = quantize_model(model, dtype)
        tok = train_bpe([_corpus_text()], rs.spec.model.vocab_size, show_progress=False)
        return model, tok, rs.spec.name or path.stem, params
    from llmkit.serving.loading import load_served

    served = load_served(path, weights=weights, device=device, dtype=dtype)
    return served.model, served.tokenizer, served.name, served.params


def _prompts(tokenizer: Any, count: int, length: int, vocab: int) -> list[list[int]]:
    ids = tokenizer.encode(_corpus_text(400_000)) if tokenizer is not None else []
    ids = [i for i in ids if i < vocab]
    if len(ids) < length * count:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (length * count,), generator=gen).tolist()
    stride = max((len(ids) - length) // count, 1)
    return [ids[k * stride : k * stride + length] for k in range(count)]


def _sequential(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds to generate each prompt alone (greedy, ``max_tokens`` each), summed."""
    from llmkit.inference import Generator, prepare_for_decoding

    prepare_for_decoding(model)  # llmkit generate's layout for one row
    gen = Generator(model, tokenizer)
    kwargs = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    gen.generate([prompts[0]], **kwargs)  # warm-up
    start = time.perf_counter()
    for p in prompts:
        gen.generate([p], **kwargs)
    elapsed = time.perf_counter() - start
    prepare_for_decoding(model, column_major=False)  # the server's: many rows at a time
    return elapsed


async def _client_run(
    url: str, name: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[list[dict[str, Any]], float]:
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency + 4)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> dict[str, Any]:
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.perf_counter()
        stamps: list[float] = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise LlmkitError(f"bench serve: the server answered {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise LlmkitError(f"bench serve: {chunk['error']['message']}")
                stamps.append(time.perf_counter())
        return {"sent": sent, "stamps": stamps}

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            records.append(await one(client, prompt))

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await one(client, prompts[0])  # warm-up: not timed
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return records, wall


def bench_serve(
    source: str | Path,
    *,
    concurrency: int = 16,
    requests: int = 32,
    prompt_len: int = 32,
    max_tokens: int = 64,
    sequential: int | None = None,
    max_batch: int = 16,
    prefill_tokens: int = 512,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    weights: str = "final",
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); the figures as a dict."""
    from llmkit import hardware
    from llmkit.serving import Engine
    from llmkit.serving.server import ServerThread

    dev = hardware.choose_device(device)
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer, name, params = _load(source, weights, dev, dtype)
    limit = model.config.max_seq_len
    if prompt_len + max_tokens > limit:
        raise LlmkitError(
            f"--prompt-len + --max-tokens = {prompt_len + max_tokens} is more than the "
            f"model's context of {limit}"
        )
    prompts = _prompts(tokenizer, requests, prompt_len, model.config.vocab_size)
    n_seq = requests if sequential is None else min(sequential, requests)
    seq_s = _sequential(model, tokenizer, prompts[:n_seq], max_tokens) if n_seq else None
    engine = Engine(model, tokenizer, max_batch=max_batch, prefill_tokens=prefill_tokens)
    with ServerThread(engine, model_name=name, max_concurrent=max(64, concurrency)) as server:
        records, wall = asyncio.run(_client_run(server.url, name, prompts, max_tokens, concurrency))
    tokens = sum(len(r["stamps"]) for r in records)
    if tokens != requests * max_tokens:
        raise LlmkitError(f"bench serve: {tokens} tokens came back, not {requests * max_tokens}")
    ttft = np.array([r["stamps"][0] - r["sent"] for r in records])
    itl = np.concatenate([np.diff(r["stamps"]) for r in records])
    latency = np.array([r["stamps"][-1] - r["sent"] for r in records])
    rate = tokens / wall
    seq_rate = n_seq * max_tokens / seq_s if seq_s else None
    info = getattr(model, "quantization", None)
    return {
        "model": name,
        "params": params,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "dtype": info.method if info is not None else dtype,
        "concurrency": concurrency,
        "requests": requests,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "max_batch": max_batch,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": rate,
        "sequential_requests": n_seq,
        "sequential_tokens_per_s": seq_rate,
        "speedup": rate / seq_rate if seq_rate else None,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "itl_p50_s": float(np.percentile(itl, 50)),
        "itl_p99_s": float(np.percentile(itl, 99)),
        "latency_p50_s": float(np.percentile(latency, 50)),
        "peak_batch": engine.peak_rows,
    }
