"""PLE: Progressive Layered Extraction (Tang et al., RecSys 2020) for click and buy.

Each extraction level (a CGC, Customized Gate Control, layer) has, per task, its own
experts and a gate, plus experts shared by all tasks. Task ``k``'s gate is a softmax over
its own and the shared experts' outputs, computed from task ``k``'s input; it weights
their sum into task ``k``'s output. Every level but the last also has a shared gate over
all experts, whose mix is the shared experts' input at the next level: that is the
"progressive" part, separating task-specific and shared knowledge level by level.
Per-task towers turn the last level's outputs into probabilities.

PERSIA's signature ``forward(non_id_type_feature_tensors,
id_type_feature_embedding_tensors)``: the 17 slot embeddings (batch, 16) in
``embedding_config.yml`` order (no non-ID features in this schema). Returns a list of
per-task probabilities, each (batch, 1), in :attr:`PLE.tasks` order (click, buy); the
training script sums one binary cross-entropy per task.
"""

from __future__ import annotations

import torch
from torch import nn


def _mlp(width: int, hidden: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers)


class TaskBranch(nn.Module):
    """One task's experts and gate within a CGC layer."""

    def __init__(self, in_dim: int, num_experts: int, num_shared: int,
                 expert_hidden: tuple[int, ...]):
        super().__init__()
        self.experts = nn.ModuleList([_mlp(in_dim, expert_hidden) for _ in range(num_experts)])
        self.gate = nn.Linear(in_dim, num_experts + num_shared)

    def forward(self, x: torch.Tensor, shared: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns (gated output, this task's expert outputs)."""
        own = [e(x) for e in self.experts]
        stacked = torch.stack(own + shared, dim=1)                       # (B, E, d)
        weights = torch.softmax(self.gate(x), dim=-1).unsqueeze(-1)      # (B, E, 1)
        return (weights * stacked).sum(dim=1), own


class CGCLayer(nn.Module):
    """A Customized Gate Control layer (one extraction level of PLE).

    Args:
        in_dim: width of every input (task inputs and the shared input).
        num_tasks: tasks.
        experts_per_task, shared_experts: expert counts.
        expert_hidden: hidden widths of each expert; the last is the output width.
        shared_output: also gate all experts into a shared output (every level but the
            last).
    """

    def __init__(self, in_dim: int, num_tasks: int, experts_per_task: int,
                 shared_experts: int, expert_hidden: tuple[int, ...], shared_output: bool):
        super().__init__()
        self.branches = nn.ModuleList([
            TaskBranch(in_dim, experts_per_task, shared_experts, expert_hidden)
            for _ in range(num_tasks)])
        self.shared_experts = nn.ModuleList([_mlp(in_dim, expert_hidden)
                                             for _ in range(shared_experts)])
        self.has_shared_output = shared_output
        total = num_tasks * experts_per_task + shared_experts
        self.shared_gate = nn.Linear(in_dim, total) if shared_output else nn.Identity()

    def forward(self, task_inputs: list[torch.Tensor], shared_input: torch.Tensor
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
        shared = [e(shared_input) for e in self.shared_experts]
        outputs: list[torch.Tensor] = []
        every: list[torch.Tensor] = []
        for i, branch in enumerate(self.branches):
            out, own = branch(task_inputs[i], shared)
            outputs.append(out)
            every += own
        if self.has_shared_output:
            stacked = torch.stack(every + shared, dim=1)
            weights = torch.softmax(self.shared_gate(shared_input), dim=-1).unsqueeze(-1)
            shared_out = (weights * stacked).sum(dim=1)
        else:
            shared_out = shared_input
        return outputs, shared_out


class PLE(nn.Module):
    """Embeddings -> ``levels`` CGC layers -> per-task towers -> probabilities.

    Args:
        num_slots: slots (one embedding each), 17 for the Taobao schema.
        embedding_dim: ``dim`` of every slot.
        num_dense: non-ID features concatenated to the embeddings (0 for Taobao).
        tasks: task names, in label order.
        levels: extraction levels.
        experts_per_task, shared_experts: experts per level.
        expert_hidden: hidden widths of an expert.
        tower_hidden: hidden widths of a task tower.
    """

    def __init__(self, num_slots: int = 17, embedding_dim: int = 16, num_dense: int = 0,
                 tasks: tuple[str, ...] = ("click", "buy"), levels: int = 2,
                 experts_per_task: int = 2, shared_experts: int = 2,
                 expert_hidden: tuple[int, ...] = (128, 64),
                 tower_hidden: tuple[int, ...] = (32,)):
        super().__init__()
        if levels < 1 or not tasks:
            raise ValueError(f"need levels >= 1 and at least one task, got {levels}, {tasks}")
        self.tasks = list(tasks)
        self.num_slots = num_slots
        self.embedding_dim = embedding_dim
        in_dim = num_slots * embedding_dim + num_dense
        layers = []
        for level in range(levels):
            layers.append(CGCLayer(in_dim, len(tasks), experts_per_task, shared_experts,
                                   tuple(expert_hidden), shared_output=level < levels - 1))
            in_dim = expert_hidden[-1]
        self.levels = nn.ModuleList(layers)
        self.towers = nn.ModuleList([
            nn.Sequential(_mlp(in_dim, tuple(tower_hidden)),
                          nn.Linear(tower_hidden[-1] if tower_hidden else in_dim, 1))
            for _ in tasks])

    def forward(self, non_id_type_feature_tensors: list[torch.Tensor],
                id_type_feature_embedding_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        x = torch.cat([e.float() for e in id_type_feature_embedding_tensors]
                      + [t.float() for t in non_id_type_feature_tensors], dim=1)
        task_inputs = [x for _ in self.tasks]
        shared = x
        for layer in self.levels:
            task_inputs, shared = layer(task_inputs, shared)
        out: list[torch.Tensor] = []
        for i, tower in enumerate(self.towers):
            out.append(torch.sigmoid(tower(task_inputs[i])))
        return out
