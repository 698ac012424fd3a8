"""mHC-lite in plain PyTorch: the golden reference (run it in float64) and the torch backend.

n = 4 residual streams x [T, n, C], mixed per token by a doubly-stochastic matrix that is a convex
combination of the n! permutation matrices.

    K1  inv_rms = (mean(x_flat^2) + eps)^-1/2 over the n*C vector;  proj = inv_rms * x_flat W^T
    K2  h_pre  = sigmoid(alpha_pre * proj[:, :n] + b_pre)
        h_post = 2 sigmoid(alpha_post * proj[:, n:2n] + b_post)
        a_res  = softmax(alpha_res * proj[:, 2n:] + b_res)          (over the n! permutations)
        H_res  = sum_k a_res[k] P_k
    K3  layer_input[t, c] = sum_j h_pre[t, j] x[t, j, c]
    K4  x_new[t, i, c]    = sum_j H[t, i, j] x[t, j, c] + h_post[t, i] F_out[t, c]
"""

import itertools

import torch

N_STREAMS = 4
EPS = 1e-6


def permutation_matrices(n: int = N_STREAMS, dtype=torch.float32, device=None) -> torch.Tensor:
    """[n!, n, n]: P_k[i, j] = 1 where permutation k sends row i to column j; identity first."""
    perms = list(itertools.permutations(range(n)))
    P = torch.zeros(len(perms), n, n, dtype=dtype, device=device)
    for k, p in enumerate(perms):
        P[k, torch.arange(n), torch.tensor(p)] = 1
    return P


def rmsnorm_project_ref(x_flat, W, eps: float = EPS):
    """x_flat [T, n*C], W [2n + n!, n*C] -> (proj [T, 2n + n!], inv_rms [T])."""
    inv_rms = torch.rsqrt(x_flat.square().mean(-1) + eps)
    return (x_flat * inv_rms[:, None]) @ W.T, inv_rms


def coefficients_ref(proj, alpha_pre, alpha_post, alpha_res, b_pre, b_post, b_res, n: int = N_STREAMS):
    """proj [T, 2n + n!] -> (h_pre [T, n], h_post [T, n], H_res [T, n, n])."""
    h_pre = torch.sigmoid(alpha_pre * proj[:, :n] + b_pre)
    h_post = 2 * torch.sigmoid(alpha_post * proj[:, n : 2 * n] + b_post)
    a_res = torch.softmax(alpha_res * proj[:, 2 * n :] + b_res, dim=-1)
    P = permutation_matrices(n, dtype=proj.dtype, device=proj.device)
    return h_pre, h_post, torch.einsum("tk,kij->tij", a_res, P)


def pre_map_ref(x, h_pre):
    """x [T, n, C], h_pre [T, n] -> [T, C]."""
    return torch.einsum("tj,tjc->tc", h_pre, x)


def post_res_ref(x, layer_output, H, h_post):
    """x [T, n, C], layer_output [T, C], H [T, n, n], h_post [T, n] -> [T, n, C]."""
    return torch.einsum("tij,tjc->tic", H, x) + h_post[:, :, None] * layer_output[:, None, :]
