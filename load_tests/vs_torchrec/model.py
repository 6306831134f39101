"""The benchmark's model: the slots' embeddings and the dense features into an MLP.

PERSIA's forward signature (dense tensors, then one (batch, dim) embedding per slot in
``embedding_config.yml`` order); ``torchrec_train.py`` builds the same MLP after its
embeddings. Returns click probabilities of shape (batch, 1).
"""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    tasks: list[str] = ["click"]

    def __init__(self, slots: int = 26, dim: int = 16, dense: int = 13,
                 hidden: tuple[int, ...] | list[int] = (512, 256)):
        super().__init__()
        width = slots * dim + dense
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers += [nn.Linear(width, 1), nn.Sigmoid()]
        self.mlp = nn.Sequential(*layers)

    def forward(self, non_id_type_feature_tensors: list[torch.Tensor],
                id_type_feature_embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.mlp(torch.cat([*id_type_feature_embedding_tensors,
                                   *non_id_type_feature_tensors], dim=1))
