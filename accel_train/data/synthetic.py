"""Random data (`--data random`): uniform uint8 images and labels from the seed."""

from __future__ import annotations

import torch


def random_data(
    train_samples: int,
    test_samples: int,
    seed: int,
    size: int = 32,
    num_classes: int = 10,
    splits=("train", "test"),
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Uniform random uint8 images and labels, the same for the same seed on every rank."""
    out = {}
    for i, (split, n) in enumerate((("train", train_samples), ("test", test_samples))):
        if split not in splits:
            continue
        g = torch.Generator().manual_seed(seed * 2 + i)
        images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, num_classes, (n,), generator=g)
        out[split] = (images, labels)
    return out
