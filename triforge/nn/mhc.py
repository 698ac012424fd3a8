import math

import torch
from torch import nn

from triforge.ops.mhc import (
    N_PROJ,
    N_STREAMS,
    coefficients,
    fused_post_res,
    fused_pre_map,
    fused_rmsnorm_project,
)
from triforge.ops.mhc.reference import EPS, post_res_ref, pre_map_ref, rmsnorm_project_ref


def expand_streams(hidden: torch.Tensor, n_streams: int = N_STREAMS) -> torch.Tensor:
    """[..., C] -> [..., n, C]: every stream starts as a copy of the hidden state."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], n_streams, hidden.shape[-1]).contiguous()


def reduce_streams(streams: torch.Tensor) -> torch.Tensor:
    """[..., n, C] -> [..., C]: the streams summed back into one hidden state."""
    return streams.sum(-2)


class MHCLiteBlock(nn.Module):
    """mHC-lite hyper-connections around ``layer`` (attention or MLP, [..., C] -> [..., C]).

    Input and output are the residual streams [..., n, C]. ``layer_has_residual=True`` serves a
    layer that adds its own input back: the op then takes H_merged = H_res - h_post (outer) h_pre.
    ``backend="torch"`` runs the same math in plain PyTorch (the reference).
    """

    def __init__(self, layer: nn.Module, hidden_size: int, n_streams: int = N_STREAMS, backend: str = "triton",
                 layer_has_residual: bool = False, eps: float = EPS):
        super().__init__()
        if n_streams != N_STREAMS:
            raise ValueError(f"n_streams must be {N_STREAMS}: the mHC-lite kernels are specialised for 4 streams, got {n_streams}")
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.layer = layer
        self.hidden_size = hidden_size
        self.n_streams = n_streams
        self.backend = backend
        self.layer_has_residual = layer_has_residual
        self.eps = eps
        n = n_streams
        self.W = nn.Parameter(torch.zeros(N_PROJ, n * hidden_size))
        self.b_pre = nn.Parameter(torch.tensor([1.0] + [-1.0] * (n - 1)))
        self.b_post = nn.Parameter(torch.tensor([1.0] + [-1.0] * (n - 1)))
        b_res = torch.full((math.factorial(n),), -8.0)
        b_res[0] = 0.0  # the identity permutation
        self.b_res = nn.Parameter(b_res)
        self.alpha_pre = nn.Parameter(torch.tensor(0.01))
        self.alpha_post = nn.Parameter(torch.tensor(0.01))
        self.alpha_res = nn.Parameter(torch.tensor(0.01))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, n_streams={self.n_streams}, backend={self.backend!r}"

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        n, C = self.n_streams, self.hidden_size
        if streams.dim() < 3 or tuple(streams.shape[-2:]) != (n, C):
            raise ValueError(f"streams must be [..., {n}, {C}], got {tuple(streams.shape)}")
        lead = streams.shape[:-2]
        x = streams.reshape(-1, n, C)
        T = x.shape[0]
        cdt = torch.promote_types(x.dtype, torch.float32)  # the torch backend's compute dtype
        if self.backend == "triton":
            x = x.contiguous()
            proj, _ = fused_rmsnorm_project(x.view(T, n * C), self.W.float(), self.eps)
        else:
            proj, _ = rmsnorm_project_ref(x.reshape(T, n * C).to(cdt), self.W.to(cdt), self.eps)
        h_pre, h_post, H = coefficients(proj, self.alpha_pre, self.alpha_post, self.alpha_res,
                                        self.b_pre, self.b_post, self.b_res)
        if self.backend == "triton":  # the kernels take fp32 coefficients whatever the parameters' dtype
            h_pre, h_post, H = h_pre.float(), h_post.float(), H.float()
        if self.layer_has_residual:
            H = H - h_post[:, :, None] * h_pre[:, None, :]
        if self.backend == "triton":
            layer_in = fused_pre_map(x, h_pre.contiguous())
        else:
            layer_in = pre_map_ref(x.to(cdt), h_pre).to(x.dtype)
        out = self.layer(layer_in.view(*lead, C)).reshape(T, C)
        if self.backend == "triton":
            new = fused_post_res(x, out.contiguous(), H.contiguous(), h_post.contiguous())
        else:
            new = post_res_ref(x.to(cdt), out.to(cdt), H, h_post).to(x.dtype)
        return new.view(*lead, n, C)
