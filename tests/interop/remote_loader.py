"""Load llmkit remote-code exports the way a user does, in a fresh process:
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``.

``python tests/interop/remote_loader.py RESULT DIR... [--no-llmkit DIR...]``: for each
directory, the load error (its type and message) or the logits of fixed inputs (two rows,
and the same rows with the second left-padded) and greedy continuations with and without the
KV cache; ``--no-llmkit`` makes llmkit unimportable for the directories after it. Results go
to RESULT with ``torch.save``. The test sets ``HF_MODULES_CACHE`` (transformers copies remote
code there) to a temporary directory and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

NEW_TOKENS = 6


def run(path: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded by 3
    with torch.no_grad():
        logits = model(ids).logits
        padded = model(ids, attention_mask=mask).logits
    prompt = ids[:1, :5]
    greedy = {
        cache: model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=cache, pad_token_id=0
        )[0, prompt.shape[1] :].tolist()
        for cache in (True, False)
    }
    return {
        "class": type(model).__name__,
        "ids": ids,
        "mask": mask,
        "logits": logits,
        "padded": padded,
        "prompt": prompt[0].tolist(),
        "greedy": greedy,
    }


def main(argv: list[str]) -> None:
    out, results = argv[0], {}
    for arg in argv[1:]:
        if arg == "--no-llmkit":
            sys.modules["llmkit"] = None  # `import llmkit` now raises ImportError
            continue
        results[arg] = run(arg)
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1:])
