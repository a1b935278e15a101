"""EVS's kept set when its scores are computed in bfloat16, as vLLM computes them in the model's dtype,
against the exact rule (float32, what the arena runs): their overlap, and which frames each keeps.

    python -m tools.evs_dtype                      # Qwen2-VL-2B's width, 16 frames of 256 tokens
    python -m tools.evs_dtype --seeds 5 --noise 0.01,0.1 --rates 0.5,0.9

The videos are synthetic embeddings: a still background (one random vector per place), each frame
adding noise of ``--noise`` times the background's scale (a camera's grain), and one object of
``--object`` tokens moving a place a frame. Near 1 a bfloat16 cosine is a multiple of 2^-8, so the
dissimilarities of still places round to a few values and tie; the stable sort then keeps the
earlier frames' tokens. Overlap is the share of the exact rule's kept tokens that bfloat16 keeps
too (the first frame, kept by both, included). This CPU's bfloat16 arithmetic, not a GPU's.
"""

from __future__ import annotations

import argparse
import sys

import torch

from backends.evs import retention_mask


def video(frames: int, per_frame: int, width: int, noise: float, object_tokens: int, seed: int) -> torch.Tensor:
    """(frames, per_frame, width) embeddings: a still background with grain, one object moving."""
    g = torch.Generator().manual_seed(seed)
    background = torch.randn(per_frame, width, generator=g)
    thing = torch.randn(width, generator=g)
    out = background + noise * torch.randn(frames, per_frame, width, generator=g)
    for t in range(frames):
        start = t % (per_frame - object_tokens)
        out[t, start:start + object_tokens] = thing + noise * torch.randn(object_tokens, width, generator=g)
    return out


def compare(embeds: torch.Tensor, rate: float) -> tuple[float, float, float]:
    """(overlap, mean frame kept after the first: exact, bfloat16)."""
    exact, rounded = retention_mask(embeds, rate), retention_mask(embeds, rate, dtype=torch.bfloat16)
    frame = torch.arange(embeds.shape[0]).unsqueeze(1).expand_as(exact)
    later = lambda m: frame[1:][m[1:]].float().mean().item() if m[1:].any() else float("nan")  # noqa: E731
    return (exact & rounded).sum().item() / exact.sum().item(), later(exact), later(rounded)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.evs_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--per-frame", type=int, default=256, help="tokens per frame")
    p.add_argument("--width", type=int, default=1536, help="embedding size (Qwen2-VL-2B's hidden size)")
    p.add_argument("--object", type=int, default=8, help="tokens of the moving object")
    p.add_argument("--noise", default="0.03,0.3,1", help="grain per frame, a share of the background's scale")
    p.add_argument("--rates", default="0.5,0.75,0.9", help="pruning rates q")
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    try:
        noises = [float(x) for x in args.noise.split(",")]
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError:
        print("--noise and --rates take comma-separated numbers", file=sys.stderr)
        return 2
    if not (args.frames > 1 and args.per_frame > args.object > 0 and args.width > 0 and args.seeds > 0
            and all(0 <= r < 1 for r in rates) and all(n >= 0 for n in noises)):
        print("need --frames > 1, --per-frame > --object > 0, --width and --seeds > 0, rates in [0, 1), noise >= 0",
              file=sys.stderr)
        return 2
    print(f"{args.frames} frames of {args.per_frame} tokens, width {args.width}, {args.seeds} seeds; "
          "overlap of the kept sets (min-max over seeds), mean frame kept after the first (exact / bfloat16)")
    print("| noise | q | overlap | mean frame, exact | mean frame, bfloat16 |\n|---|---|---|---|---|")
    every = []
    for noise in noises:
        for rate in rates:
            runs = [compare(video(args.frames, args.per_frame, args.width, noise, args.object, s), rate)
                    for s in range(args.seeds)]
            overlaps = [r[0] for r in runs]
            every += overlaps
            mean = lambda i: sum(r[i] for r in runs) / len(runs)  # noqa: E731
            print(f"| {noise:g} | {rate:g} | {min(overlaps):.2f}-{max(overlaps):.2f} | {mean(1):.1f} | {mean(2):.1f} |")
    print(f"overlap over every cell: {min(every):.2f}-{max(every):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
