"""Token sampling on the last stage: greedy, temperature, top-k, top-p, per-token seeds.

Every sampled row draws from its own generator seeded by the plan (request seed mixed with
the token's position), so a seeded request gets the same tokens however it was batched.
"""
from __future__ import annotations

import torch

from pp_runtime.batch import SampleSpec


# Temperatures below this are greedy, as in vLLM: dividing by them only turns ties and
# near-ties into coin flips, and such a request would lose greedy's same-tokens-everywhere promise.
SAMPLING_EPS = 1e-5


def is_greedy(s: SampleSpec) -> bool:
    """Whether ``sample`` takes this row's argmax."""
    return not (s.temperature >= SAMPLING_EPS and s.top_k != 1)


def sample_hidden(model: torch.nn.Module, h: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """The tokens of the sampled rows' hidden states h (S, H) (the last stage's model): with every
    row greedy only their argmax (``model.argmax_tokens``: the same ids, less work), else
    ``sample`` over the logits. Every TP rank calls it (the LM head gathers across them)."""
    if all(is_greedy(s) for s in specs):
        return model.argmax_tokens(h).tolist()
    return sample(model.logits(h), specs)


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """logits (S, V), one spec per row -> S token ids."""
    if logits.shape[0] != len(specs):
        raise ValueError(f"sample: {logits.shape[0]} logit rows but {len(specs)} sampling specs")
    logits = logits.float()  # half-precision logits would make the softmax below coarse
    out = logits.argmax(dim=-1).tolist()
    for i, s in enumerate(specs):
        if not is_greedy(s):
            out[i] = _sample_row(logits[i], s)
    return out


def _sample_row(logits: torch.Tensor, s: SampleSpec) -> int:  # logits (V,)
    # Shift the maximum to 0 before dividing: a tiny temperature then sends the others to
    # -inf instead of overflowing everything to inf (whose softmax is NaN and crashes multinomial).
    # In float64: a temperature below float32's smallest subnormal (~1.4e-45) would round to 0
    # there and make the maximum 0 / 0 = NaN; float64 holds any positive Python float.
    x = (logits - logits.max()).double() / s.temperature
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token once the mass of the tokens strictly before it already reaches top_p;
        # the most likely token always stays.
        drop = (probs.cumsum(-1) - probs) >= s.top_p
        x = x.scatter(0, order[drop], float("-inf"))
    g = torch.Generator(device=logits.device).manual_seed(s.seed)
    return int(torch.multinomial(x.softmax(-1), 1, generator=g).item())
