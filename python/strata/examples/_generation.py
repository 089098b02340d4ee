"""What `generate` and its `--mirage` demo (`mirage_demo.py`) share: greedy generation with a
progress bar, and byte counts for people."""

import time


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def generate_with_progress(model, ids, mask, cache, new_tokens, desc, on_step=None):
    """Greedy generation of exactly `new_tokens` with a progress bar; `on_step()` after each
    token. Returns the output ids and the seconds it took."""
    import torch
    from tqdm.auto import tqdm
    from transformers import LogitsProcessor, LogitsProcessorList

    bar = tqdm(total=new_tokens, unit="tok", desc=desc)

    class Progress(LogitsProcessor):
        def __call__(self, input_ids, scores):
            bar.update(1)
            if on_step is not None:
                on_step()
            return scores

    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([Progress()]),
            )
    finally:
        bar.close()
    return out, time.perf_counter() - start
