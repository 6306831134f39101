"""The synthetic click model: summed slot embeddings and dense features into an MLP.

PERSIA's model signature: ``forward(non_id_type_feature_tensors,
id_type_feature_embedding_tensors)`` with lists of tensors in the order of the batch's
features (here one dense tensor, and one (batch, dim) embedding per slot in
``embedding_config.yml`` order). Returns click probabilities of shape (batch, 1).
"""

from __future__ import annotations

import torch
from torch import nn


class DNN(nn.Module):
    """Concatenated embeddings + dense features -> MLP -> sigmoid.

    Args:
        num_slots: ID features (one embedding each).
        embedding_dim: ``dim`` of every slot in ``embedding_config.yml``.
        num_dense: dense features.
        hidden: widths of the hidden layers.
    """

    #: head names for serving (recorded in checkpoints, used by the HTTP API)
    tasks: list[str] = ["click"]

    def __init__(self, num_slots: int = 26, embedding_dim: int = 8, num_dense: int = 4,
                 hidden: tuple[int, ...] = (256, 128)):
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
        if len(id_type_feature_embedding_tensors) != self.num_slots:
            raise ValueError(f"expected {self.num_slots} slot embeddings, got "
                             f"{len(id_type_feature_embedding_tensors)}")
        parts = [e.float() for e in id_type_feature_embedding_tensors]
        parts += [t.float() for t in non_id_type_feature_tensors]
        return torch.sigmoid(self.mlp(torch.cat(parts, dim=1)))
