"""The Adult income model: slot embeddings and numeric features into an MLP.

PERSIA's signature ``forward(non_id_type_feature_tensors,
id_type_feature_embedding_tensors)``: one (batch, 6) numeric tensor and one (batch, dim)
embedding per categorical slot, in ``embedding_config.yml`` order. Returns the
probability of income > 50K, shape (batch, 1).
"""

from __future__ import annotations

import torch
from torch import nn


class DNN(nn.Module):
    """Concatenated embeddings + numerics -> MLP -> sigmoid.

    Args:
        num_slots: categorical slots (one embedding each).
        embedding_dim: ``dim`` of the slots in ``embedding_config.yml``.
        num_dense: numeric features.
        hidden: widths of the hidden layers.
    """

    #: head names for serving (recorded in checkpoints, used by the HTTP API)
    tasks: list[str] = ["income"]

    def __init__(self, num_slots: int = 8, embedding_dim: int = 8, num_dense: int = 6,
                 hidden: tuple[int, ...] = (128, 64)):
        super().__init__()
        self.num_slots = num_slots
        self.embedding_dim = embedding_dim
        width = num_slots * embedding_dim + num_dense
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, non_id_type_feature_tensors: list[torch.Tensor],
                id_type_feature_embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([e.float() for e in id_type_feature_embedding_tensors]
                      + [t.float() for t in non_id_type_feature_tensors], dim=1)
        return torch.sigmoid(self.mlp(x))
