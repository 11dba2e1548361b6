"""Small learned modules that some methods add next to the policy (pure torch)."""
from __future__ import annotations

import torch


class LogZHead(torch.nn.Module):
    """FlowRL's learned log-partition ``log Z_phi(x)``: ``Linear -> GELU -> Linear`` on the
    *detached* mean-pooled last-layer hidden states of the prompt, ``[B, H] -> [B]``.
    Engines own and optimise it (``Method.needs.prompt_hidden``)."""

    def __init__(self, hidden_size: int, width: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(hidden_size, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, 1))

    def forward(self, prompt_hidden: torch.Tensor) -> torch.Tensor:
        return self.net(prompt_hidden.detach().float()).squeeze(-1)


def make_log_z_head(kind: str, hidden_size: int) -> torch.nn.Module:
    """The FlowRL log Z head a method asks for (hyperparameter ``log_z_head``):
    ``small_detached`` (:class:`LogZHead`, the library's) or ``authors`` (Xuekai-Zhu/FlowRL's
    ``ProjZModule``, not detached: :class:`~.authors.AuthorsLogZHead`)."""
    from ._utils import unknown_name_error
    from .authors import LOG_Z_HEADS, AuthorsLogZHead

    if kind == "small_detached":
        return LogZHead(hidden_size)
    if kind == "authors":
        return AuthorsLogZHead(hidden_size)
    raise unknown_name_error("log_z_head", kind, LOG_Z_HEADS)
