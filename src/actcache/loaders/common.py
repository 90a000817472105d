"""What every loader shares: which vectors of the cache it reads (patches x layer)."""

from __future__ import annotations

import dataclasses

import numpy as np

from actcache.errors import ConfigError
from actcache.loaders.options import PATCHES
from actcache.protocol import Metadata


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which tokens and layers of each image a loader yields.

    patches: "cls" (the CLS token only; an error when the cache has none), "image" (patch tokens,
    CLS excluded), "all" (every stored token). layer: a recorded layer value, or "all".
    Examples are ordered image-major: for each image, for each selected layer, each selected token.
    """

    metadata: Metadata
    patches: str = "image"
    layer: int | str = -2

    def __post_init__(self) -> None:
        md = self.metadata
        if self.patches not in PATCHES:
            raise ConfigError(f"patches={self.patches!r} is not allowed; use one of {', '.join(PATCHES)}")
        if self.patches == "cls" and not md.cls_token:
            raise ConfigError(
                f"patches='cls' but this cache has no CLS token (vit_family={md.vit_family!r}, "
                "cls_token=false); use patches='image' or 'all'."
            )
        if self.layer != "all":
            if isinstance(self.layer, bool) or not isinstance(self.layer, int):
                raise ConfigError(f"layer={self.layer!r} must be a recorded layer value or 'all'")
            md.layer_index(self.layer)  # raises listing the recorded layers

    @property
    def layer_idx(self) -> list[int]:
        """Positions (into metadata.layers) of the selected layers."""
        if self.layer == "all":
            return list(range(len(self.metadata.layers)))
        return [self.metadata.layers.index(self.layer)]

    @property
    def token_start(self) -> int:
        return 1 if (self.patches == "image" and self.metadata.cls_token) else 0

    @property
    def n_tokens(self) -> int:
        md = self.metadata
        if self.patches == "cls":
            return 1
        if self.patches == "image":
            return md.n_patches_per_img
        return md.n_tokens_per_img

    @property
    def per_img(self) -> int:
        """Examples per image."""
        return len(self.layer_idx) * self.n_tokens

    @property
    def n_examples(self) -> int:
        return self.metadata.n_imgs * self.per_img

    def decode(self, i):
        """Example index -> (image_i, layer value, patch_i); patch_i is -1 for the CLS token.

        Works elementwise on numpy arrays too.
        """
        img, rem = divmod(i, self.per_img)
        lpos, tok = divmod(rem, self.n_tokens)
        token = tok + self.token_start  # position on the stored token axis
        patch = token - int(self.metadata.cls_token)  # patch index; CLS -> -1
        layers = np.asarray(self.metadata.layers)[np.asarray(self.layer_idx)[lpos]]
        return img, layers, token, patch
