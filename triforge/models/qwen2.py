"""Qwen2 decode engine on triforge kernels (Qwen2.5-0.5B and the rest of the family without sliding
window or RoPE scaling).

    engine = Qwen2Engine.from_hf(model)                  # a transformers Qwen2ForCausalLM
    engine = Qwen2Engine.from_pretrained("path/to/dir")  # config.json + *.safetensors, no hub access
    out = engine.generate(input_ids, max_new_tokens=32)  # [B, T + 32]: prompt + new tokens

Prefill (the prompt, T tokens per row) runs GEMMs through torch.matmul (cuBLAS) and triforge's
RMSNorm (residual add fused), RoPE, SwiGLU and FlashAttention kernels. Each decode step (one token
per row) is four launches per layer at batch <= 2 with a short cache (six otherwise), all
memory-bound, with every elementwise op fused into a GEMV (``triforge.ops.gemv``):

    1. gemv_qkv_rope   input RMSNorm + QKV projection + bias + RoPE; k, v written into the cache
    2. flash_decode_oproj  attention over the cache + o_proj + residual add, one launch
       (triforge.ops.attention.decode_oproj; where it does not fit (decode_oproj.fits: batch > 2 or a
       cache over 2048 rows) or TRIFORGE_FUSED_ATTN=0, three launches instead: flash-decoding's split
       and merge kernels (one split: the split kernel writes the output itself), then the o_proj GEMV)
    3. gemv_gate_up    post-attention RMSNorm + gate/up projections + SwiGLU
    4. gemv            down_proj + residual add

then the final RMSNorm + lm_head (one gemv) and the argmax. On CUDA the step is captured once per
decode state in a CUDA graph over static buffers (token ids, positions, caches), so a step costs one
graph launch instead of ~150 kernel launches; the prefill is captured too, once per prompt length.

Weights: q/k/v and gate/up are concatenated along the output dimension at load ([(Hq + 2 Hkv) D, C]
and [2I, C]); every matrix keeps nn.Linear's row-major [N, K] layout (see triforge/ops/gemv.py).
The KV cache is [L, B, S_max, Hkv, D] per k and v; row b's token at position p sits at [l, b, p].
Prompts in a batch have equal length (no padding), so every row sits at the same position.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from triforge import _runtime, launch
from triforge.ops.attention import decode_oproj, flash_attn_func
from triforge.ops.attention.decode import HEAD_DIMS, flash_decode_fwd
from triforge.ops.gemv import (check_mlp_sync, gemv_gate_up_launch, gemv_launch, gemv_mlp_launch, gemv_qkv_rope_launch,
                               mlp_config, rope_tables)
from triforge.ops.norm import rms_norm
from triforge.ops.rope import apply_rotary_qk
from triforge.ops.swiglu import swiglu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PREFILL_GRAPH_TOKENS = 8192  # prompts up to this many tokens (B x T) prefill through a captured graph

# per-layer stages recorded by ``trace`` (and by the parity tool on the Hugging Face side)
STAGES = (
    "input_norm",  # input RMSNorm output                      [B, T, C]
    "q_proj",  # q projection + bias, before RoPE              [B, T, Hq * D]
    "k_proj",  # k projection + bias, before RoPE              [B, T, Hkv * D]
    "v_proj",  # v projection + bias                           [B, T, Hkv * D]
    "q_rope",  # q after RoPE                                  [B, T, Hq, D]
    "k_rope",  # k after RoPE (as cached)                      [B, T, Hkv, D]
    "attn",  # attention output, before o_proj                 [B, T, Hq * D]
    "attn_residual",  # residual + o_proj(attn)                [B, T, C]
    "post_norm",  # post-attention RMSNorm output              [B, T, C]
    "swiglu",  # silu(gate) * up                               [B, T, I]
    "block",  # block output: attn_residual + down_proj(swiglu) [B, T, C]
)
FINAL_STAGES = ("final_norm", "logits")


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Qwen2Spec:
    """The dimensions the engine needs, validated from a Hugging Face config (dict or object)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config) -> "Qwen2Spec":
        """From a transformers config object or a config.json dict; unsupported features raise ValueError."""
        d = config if isinstance(config, dict) else config.to_dict()
        model_type = d.get("model_type")
        if model_type is not None and model_type != "qwen2":
            raise ValueError(f"not a Qwen2 config: model_type is {model_type!r} (expected 'qwen2')")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or isinstance(d.get(key), bool) or d[key] < 1:
                raise ValueError(f"config.{key} must be a positive int, got {d.get(key)!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.hidden_act {act!r} is not supported (Qwen2 uses 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError(
                "config.use_sliding_window is true: sliding-window attention is not supported by this engine "
                "(every layer attends over the whole cache)"
            )
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config.layer_types has {sorted(set(layer_types))}: only 'full_attention' is supported")
        theta = _rope_theta(d)
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if heads % kv_heads:
            raise ValueError(f"config.num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported; the decode attention kernel takes {HEAD_DIMS}")
        eps = float(d.get("rms_norm_eps", 1e-6))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=theta,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        )

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def _rope_theta(d) -> float:
    """The RoPE base; anything but the default (unscaled) RoPE raises ValueError."""
    params = d.get("rope_parameters")  # transformers >= 5
    scaling = d.get("rope_scaling")  # transformers 4
    for source in (params, scaling):
        if isinstance(source, dict):
            kind = source.get("rope_type", source.get("type", "default"))
            if kind != "default":
                raise ValueError(
                    f"RoPE scaling {kind!r} is not supported; only the default RoPE (no rope_scaling) is"
                )
        elif source is not None:
            raise ValueError(f"unrecognised RoPE parameters {source!r}")
    theta = (params or {}).get("rope_theta", d.get("rope_theta", 10000.0))
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
    return float(theta)


# ----------------------------------------------------------------------------- weights


@dataclass
class Qwen2Layer:
    input_norm: torch.Tensor  # [C]
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, C]: q rows, k rows, v rows
    b_qkv: torch.Tensor  # [(Hq + 2 Hkv) D]
    w_o: torch.Tensor  # [C, Hq D]
    post_norm: torch.Tensor  # [C]
    w_gate_up: torch.Tensor  # [2I, C]: gate rows, then up rows
    w_down: torch.Tensor  # [C, I]


def _load_weights(spec: Qwen2Spec, get, dtype, device):
    """(embed, layers, final norm, lm_head) from ``get(name) -> tensor or None`` (HF parameter names)."""

    def need(name, shape):
        t = get(name)
        if t is None:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)} from the config")
        return t.detach().to(device=device, dtype=dtype)

    C, I, D = spec.hidden_size, spec.intermediate_size, spec.head_dim
    hq, hkv = spec.num_heads * D, spec.num_kv_heads * D
    emb = get("model.embed_tokens.weight")
    if emb is not None and emb.shape[0] != spec.vocab_size:
        raise ValueError(
            f"the embedding has {emb.shape[0]} rows but config.vocab_size is {spec.vocab_size}: "
            "tokenizer / embedding size mismatch"
        )
    embed = need("model.embed_tokens.weight", (spec.vocab_size, C))
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(Qwen2Layer(
            input_norm=need(p + "input_layernorm.weight", (C,)),
            w_qkv=torch.cat([need(a + "q_proj.weight", (hq, C)), need(a + "k_proj.weight", (hkv, C)),
                             need(a + "v_proj.weight", (hkv, C))]).contiguous(),
            b_qkv=torch.cat([need(a + "q_proj.bias", (hq,)), need(a + "k_proj.bias", (hkv,)),
                             need(a + "v_proj.bias", (hkv,))]).contiguous(),
            w_o=need(a + "o_proj.weight", (C, hq)).contiguous(),
            post_norm=need(p + "post_attention_layernorm.weight", (C,)),
            w_gate_up=torch.cat([need(m + "gate_proj.weight", (I, C)), need(m + "up_proj.weight", (I, C))]).contiguous(),
            w_down=need(m + "down_proj.weight", (C, I)).contiguous(),
        ))
    norm = need("model.norm.weight", (C,))
    if spec.tie_word_embeddings or get("lm_head.weight") is None:
        if not spec.tie_word_embeddings:
            raise ValueError("lm_head.weight is missing and config.tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = need("lm_head.weight", (spec.vocab_size, C)).contiguous()
    return embed.contiguous(), layers, norm, lm_head


def _safetensors_getter(path: Path):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    where = {}
    handles = [safe_open(str(path / f), framework="pt") for f in files]
    for h in handles:
        for k in h.keys():
            where[k] = h

    def get(name):
        h = where.get(name)
        return h.get_tensor(name) if h is not None else None

    return get


# ----------------------------------------------------------------------------- decode state


class DecodeState:
    """A batch of sequences being decoded: KV caches, positions and the static buffers a CUDA graph
    of the decode step reads. Rows advance together (equal-length prompts)."""

    def __init__(self, engine: "Qwen2Engine", batch_size: int, max_seq_len: int):
        s = engine.spec
        shape = (s.num_layers, batch_size, max_seq_len, s.num_kv_heads, s.head_dim)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.k_cache = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.v_cache = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.positions = torch.zeros(batch_size, dtype=torch.int32, device=engine.device)  # tokens cached per row
        self.ids = torch.zeros(batch_size, dtype=torch.int64, device=engine.device)  # the step's input tokens
        self.length = 0  # tokens cached per row, on the host
        self.graph = None
        self.graph_logits = None
        self.prefill_graphs: dict = {}  # prompt length -> (graph, static ids, static logits)
        # the fused MLP kernel's grid-barrier counters (arrivals, departures, timeouts): zero between launches
        self.mlp_sync = torch.zeros(3, dtype=torch.int32, device=engine.device)
        self.mlp_fused = False  # a decode step (or its graph) launched the fused MLP kernel on this state

    def reset(self) -> None:
        self.length = 0
        self.positions.zero_()


# ----------------------------------------------------------------------------- engine


class Qwen2Engine:
    """Greedy / sampled generation for Qwen2 models on triforge kernels. See the module docstring."""

    def __init__(self, spec: Qwen2Spec, embed, layers, norm, lm_head, *, max_seq_len=None, use_cuda_graph=True):
        self.spec = spec
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self.max_seq_len = int(max_seq_len or spec.max_position_embeddings)
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len!r}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.cos, self.sin = rope_tables(spec.head_dim, self.max_seq_len, spec.rope_theta, self.device)
        self.scale = spec.head_dim ** -0.5
        # the interpreter's cost is per program: one KV split there; the split heuristic on the GPU
        self._num_splits = 1 if _runtime.INTERPRET else 0
        # decode kernels launched as programmatic dependents (sm90+): each starts, and fetches its
        # weights, while the previous one drains; False (or TRIFORGE_PDL=0) launches them plainly
        self.use_pdl = launch.pdl_wanted()
        # the MLP (gate/up + SwiGLU, down + residual) as one persistent launch with a grid barrier where a
        # tuned config exists for the shape (gemv.mlp_config); False (or TRIFORGE_FUSED_MLP=0): two launches
        self.fused_mlp = os.environ.get("TRIFORGE_FUSED_MLP", "1") != "0"
        # attention over the cache, o_proj and the residual add as one launch (decode_oproj) where the batch and
        # the cache are small (decode_oproj.fits); False (or TRIFORGE_FUSED_ATTN=0): flash-decoding + o_proj GEMV
        self.fused_attn = os.environ.get("TRIFORGE_FUSED_ATTN", "1") != "0"
        self._states: dict = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf(cls, model, *, dtype=None, device=None, max_seq_len=None, tokenizer=None, use_cuda_graph=True):
        """From a transformers Qwen2ForCausalLM. The fused q/k/v and gate/up weights are new tensors; the
        others share the model's storage when dtype and device already match (the engine never writes them)."""
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "state_dict"):
            raise TypeError(f"model must be a transformers Qwen2ForCausalLM, got {type(model).__name__}")
        spec = Qwen2Spec.from_config(config)
        params = dict(model.state_dict())
        if "lm_head.weight" in params and spec.tie_word_embeddings:
            params.pop("lm_head.weight")
        dtype = _check_dtype(dtype or params["model.embed_tokens.weight"].dtype)
        device = torch.device(device) if device is not None else _runtime.default_device()
        embed, layers, norm, lm_head = _load_weights(spec, params.get, dtype, device)
        engine = cls(spec, embed, layers, norm, lm_head, max_seq_len=max_seq_len, use_cuda_graph=use_cuda_graph)
        if tokenizer is not None:
            engine.check_tokenizer(tokenizer)
        return engine

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, device=None, max_seq_len=None, tokenizer=None, use_cuda_graph=True):
        """From a local directory holding config.json and safetensors weights (sharded or not)."""
        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json (expected a local Hugging Face model directory)")
        config = json.loads((path / "config.json").read_text())
        spec = Qwen2Spec.from_config(config)
        get = _safetensors_getter(path)
        if dtype is None:
            dtype = get("model.embed_tokens.weight").dtype
        dtype = _check_dtype(dtype)
        device = torch.device(device) if device is not None else _runtime.default_device()
        embed, layers, norm, lm_head = _load_weights(spec, get, dtype, device)
        engine = cls(spec, embed, layers, norm, lm_head, max_seq_len=max_seq_len, use_cuda_graph=use_cuda_graph)
        if tokenizer is not None:
            engine.check_tokenizer(tokenizer)
        return engine

    def check_tokenizer(self, tokenizer) -> None:
        """A tokenizer whose vocabulary holds more ids than the embedding has rows raises ValueError."""
        n = len(tokenizer)
        if n > self.spec.vocab_size:
            raise ValueError(
                f"the tokenizer has {n} tokens but the embedding has only {self.spec.vocab_size} rows: "
                "tokenizer / embedding size mismatch (wrong tokenizer for this checkpoint?)"
            )

    # ------------------------------------------------------------------ state

    def new_state(self, batch_size: int, max_seq_len: int) -> DecodeState:
        """A fresh decode state whose caches hold ``max_seq_len`` tokens per row."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if max_seq_len > self.max_seq_len:
            raise ValueError(
                f"a cache of {max_seq_len} tokens exceeds the engine's max_seq_len {self.max_seq_len}"
            )
        return DecodeState(self, batch_size, max_seq_len)

    def _state_for(self, batch_size: int, tokens: int) -> DecodeState:
        """A reusable state (and its captured graph) for generate: capacity rounded up to 256 tokens."""
        cap = min(self.max_seq_len, -(-tokens // 256) * 256)
        key = (batch_size, cap)
        state = self._states.get(key)
        if state is None:
            if len(self._states) >= 4:
                self._states.pop(next(iter(self._states)))
            state = self._states[key] = self.new_state(batch_size, cap)
        state.reset()
        return state

    # ------------------------------------------------------------------ input checks

    def _check_ids(self, input_ids, name="input_ids", ndim=2) -> torch.Tensor:
        if isinstance(input_ids, (list, tuple)):
            rows = input_ids if ndim == 1 or (input_ids and isinstance(input_ids[0], (list, tuple))) else [input_ids]
            if ndim == 2:
                lengths = {len(r) for r in rows}
                if len(lengths) > 1:
                    raise ValueError(f"{name}: prompts must have equal length (no padding support), got lengths "
                                     f"{sorted(lengths)}")
            input_ids = torch.tensor(rows, dtype=torch.int64)
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"{name} must be a tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise TypeError(f"{name} must hold integer token ids, got dtype {input_ids.dtype}")
        if ndim == 2 and input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(input_ids.shape)}")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.spec.vocab_size:
            raise ValueError(
                f"{name} holds token id {hi if hi >= self.spec.vocab_size else lo} outside the embedding's "
                f"[0, {self.spec.vocab_size}): tokenizer / embedding size mismatch?"
            )
        return input_ids.to(device=self.device, dtype=torch.int64)

    # ------------------------------------------------------------------ prefill

    @torch.no_grad()
    def prefill(self, state: DecodeState, input_ids, trace: dict | None = None) -> torch.Tensor:
        """Run the prompts input_ids [B, T] (equal length) into an empty state; returns the last
        position's logits [B, V] (the model's dtype). ``trace`` (a dict) receives every stage [B, T, ...].
        On CUDA (use_cuda_graph, B x T <= PREFILL_GRAPH_TOKENS) the prefill replays a graph captured per
        prompt length, and the returned tensor is its static output: the next prefill overwrites it."""
        ids = self._check_ids(input_ids)
        B, T = ids.shape
        if B != state.batch_size:
            raise ValueError(f"input_ids has {B} rows but the state was made for batch_size {state.batch_size}")
        if state.length:
            raise ValueError(f"the state already holds {state.length} tokens; call state.reset() before a new prefill")
        if T > state.max_seq_len:
            raise ValueError(
                f"the prompt has {T} tokens, longer than the cache ({state.max_seq_len} tokens per row)"
            )
        if self._graphed() and trace is None and B * T <= PREFILL_GRAPH_TOKENS:
            logits = self._prefill_replay(state, ids)
        else:
            logits = self._prefill(state, ids, trace)
        state.length = T
        return logits

    def _prefill_replay(self, state: DecodeState, ids: torch.Tensor) -> torch.Tensor:
        """Prefill as a CUDA graph per prompt length (captured on first use, then replayed with the new
        ids copied into its static input): the eager prefill is ~300 host-side op launches."""
        T = ids.shape[1]
        entry = state.prefill_graphs.get(T)
        if entry is None:
            static_ids = ids.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles every kernel (the caches it writes are rewritten below)
                self._prefill(state, static_ids)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._prefill(state, static_ids)
            if len(state.prefill_graphs) >= 4:
                state.prefill_graphs.pop(next(iter(state.prefill_graphs)))
            entry = state.prefill_graphs[T] = (graph, static_ids, logits)
        graph, static_ids, logits = entry
        static_ids.copy_(ids)
        graph.replay()
        return logits

    def _prefill(self, state: DecodeState, ids: torch.Tensor, trace: dict | None = None) -> torch.Tensor:
        """The prefill itself (no host sync: capturable): caches rows 0..T-1, positions = T; returns the
        last position's logits (all positions' in ``trace``)."""
        B, T = ids.shape
        s = self.spec
        D, Hq, Hkv, eps = s.head_dim, s.num_heads, s.num_kv_heads, s.rms_norm_eps
        cos, sin = self.cos[:T], self.sin[:T]
        h = F.embedding(ids, self.embed)  # [B, T, C]
        out = None
        for i, L in enumerate(self.layers):
            if out is None:
                xn = rms_norm(h, L.input_norm, eps)
            else:
                xn, h = rms_norm(out, L.input_norm, eps, residual=h)
                if trace is not None:
                    trace[f"layers.{i - 1}.block"] = h
            qkv = F.linear(xn, L.w_qkv, L.b_qkv)
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q, k = apply_rotary_qk(q.reshape(B, T, Hq, D), k.reshape(B, T, Hkv, D), cos, sin)
            v = v.reshape(B, T, Hkv, D)
            state.k_cache[i, :, :T] = k
            state.v_cache[i, :, :T] = v
            o = flash_attn_func(q, k, v, causal=True).reshape(B, T, Hq * D)
            xn2, h = rms_norm(F.linear(o, L.w_o), L.post_norm, eps, residual=h)
            gate, up = F.linear(xn2, L.w_gate_up).split(s.intermediate_size, dim=-1)
            act = swiglu(gate, up)
            out = F.linear(act, L.w_down)
            if trace is not None:
                trace.update({
                    f"layers.{i}.input_norm": xn, f"layers.{i}.q_proj": qkv[..., : Hq * D],
                    f"layers.{i}.k_proj": qkv[..., Hq * D: (Hq + Hkv) * D], f"layers.{i}.v_proj": qkv[..., (Hq + Hkv) * D:],
                    f"layers.{i}.q_rope": q, f"layers.{i}.k_rope": k, f"layers.{i}.attn": o,
                    f"layers.{i}.attn_residual": h, f"layers.{i}.post_norm": xn2, f"layers.{i}.swiglu": act,
                })
        xn, h = rms_norm(out, self.norm, eps, residual=h)
        state.positions.fill_(T)
        if trace is not None:
            trace[f"layers.{s.num_layers - 1}.block"] = h
            trace["final_norm"] = xn
            trace["logits"] = F.linear(xn, self.lm_head)
            return trace["logits"][:, -1]
        return F.linear(xn[:, -1], self.lm_head)

    # ------------------------------------------------------------------ decode

    def _decode(self, state: DecodeState, trace: dict | None = None) -> torch.Tensor:
        """One token per row (state.ids) at state.positions: the fused-kernel decode step. Returns
        logits [B, V]; does not advance the positions (the caller does)."""
        s = self.spec
        B, D, Hq, Hkv, eps = state.batch_size, s.head_dim, s.num_heads, s.num_kv_heads, s.rms_norm_eps
        tr = trace is not None
        pdl = self.use_pdl
        pos = state.positions
        lengths = pos + 1  # keys each row attends to, the new one included
        h = F.embedding(state.ids, self.embed)  # [B, C]
        mlp_cfg = mlp_config(B, s.hidden_size, s.intermediate_size, self.dtype) if self.fused_mlp else None
        fused_attn = self.fused_attn and decode_oproj.fits(B, state.max_seq_len, Hq, D)
        for i, L in enumerate(self.layers):
            kc, vc = state.k_cache[i], state.v_cache[i]
            q, qkv, xn = gemv_qkv_rope_launch(h, L.w_qkv, L.b_qkv, self.cos, self.sin, pos, kc, vc, Hq, Hkv,
                                              L.input_norm, eps, store_pre=tr, store_xn=tr, pdl=pdl)
            if fused_attn:
                h_attn, o = decode_oproj.flash_decode_oproj(q, kc, vc, lengths, L.w_o, h, self.scale, store_o=tr,
                                                            pdl=pdl)
            else:
                o, _ = flash_decode_fwd(q.view(B, 1, Hq, D), kc, vc, lengths, None, None, True, self.scale,
                                        num_splits=self._num_splits, pdl=pdl)
                o = o.view(B, Hq * D)
                h_attn, _ = gemv_launch(o, L.w_o, residual=h, pdl=pdl)
            if mlp_cfg is not None:
                state.mlp_fused = True
                h, act, xn2 = gemv_mlp_launch(h_attn, L.w_gate_up, L.post_norm, L.w_down, state.mlp_sync, eps,
                                              store_xn=tr, cfg=mlp_cfg, pdl=pdl)
            else:
                act, xn2 = gemv_gate_up_launch(h_attn, L.w_gate_up, L.post_norm, eps, store_xn=tr, pdl=pdl)
                h, _ = gemv_launch(act, L.w_down, residual=h_attn, pdl=pdl)
            if tr:
                rows = torch.arange(B, device=self.device)
                trace.update({
                    f"layers.{i}.input_norm": xn, f"layers.{i}.q_proj": qkv[:, : Hq * D],
                    f"layers.{i}.k_proj": qkv[:, Hq * D: (Hq + Hkv) * D], f"layers.{i}.v_proj": qkv[:, (Hq + Hkv) * D:],
                    f"layers.{i}.q_rope": q, f"layers.{i}.k_rope": kc[rows, pos.long()].clone(),
                    f"layers.{i}.attn": o, f"layers.{i}.attn_residual": h_attn, f"layers.{i}.post_norm": xn2,
                    f"layers.{i}.swiglu": act, f"layers.{i}.block": h,
                })
        logits, xn = gemv_launch(h, self.lm_head, norm_weight=self.norm, eps=eps, store_xn=tr, pdl=pdl)
        if tr:
            trace["final_norm"] = xn
            trace["logits"] = logits
        return logits

    def _graphed(self) -> bool:
        return self.use_cuda_graph and self.device.type == "cuda" and not _runtime.INTERPRET

    def _capture(self, state: DecodeState) -> None:
        """Record the decode step (and the position advance) in a CUDA graph over the state's buffers."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # compiles every kernel; the k/v it writes at the current position are rewritten by the real step
            for _ in range(2):
                self._decode(state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._decode(state)
            state.positions.add_(1)
        state.graph, state.graph_logits = graph, logits

    @torch.no_grad()
    def step(self, state: DecodeState, token_ids, trace: dict | None = None) -> torch.Tensor:
        """Append one token per row (token_ids [B]) and return the next logits [B, V].

        On CUDA (use_cuda_graph) the returned tensor is the graph's static output buffer: the next
        step overwrites it. ``trace`` (a dict) runs the step eagerly and receives every stage [B, ...].
        No host sync: where the fused MLP kernel runs, ``check_mlp_sync(state.mlp_sync)`` reports a
        grid-barrier timeout (generate checks it at its end).
        """
        ids = self._check_ids(token_ids, "token_ids", ndim=1)
        if ids.shape[0] != state.batch_size:
            raise ValueError(f"token_ids must have shape ({state.batch_size},), got {tuple(ids.shape)}")
        state.ids.copy_(ids)
        return self._advance(state, trace)

    def _advance(self, state: DecodeState, trace: dict | None = None) -> torch.Tensor:
        """The decode step on state.ids (no host sync: generate feeds it its own argmax)."""
        if state.length == 0:
            raise ValueError("the state is empty: prefill a prompt before decoding")
        if state.length >= state.max_seq_len:
            raise ValueError(f"the cache is full ({state.max_seq_len} tokens per row); no room for another token")
        if self._graphed() and trace is None:
            if state.graph is None:
                self._capture(state)
            state.graph.replay()
            logits = state.graph_logits
        else:
            logits = self._decode(state, trace)
            state.positions.add_(1)
        state.length += 1
        return logits

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None, pad_token_id=None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Prompts input_ids [B, T] (equal length) followed by up to ``max_new_tokens`` new tokens each.

        Greedy by default (argmax, first index on ties, as Hugging Face); ``do_sample`` samples from
        softmax(logits / temperature) restricted to the ``top_k`` most likely tokens and the smallest
        set whose probability reaches ``top_p`` (Hugging Face's order: temperature, top-k, top-p).
        With ``eos_token_id`` (int or list), a row that produced it gets ``pad_token_id`` (default: the
        first eos id) from then on, and generation stops once every row has finished.
        Returns [B, T + n] int64 token ids, n <= max_new_tokens.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        _check_sampling(do_sample, temperature, top_k, top_p)
        ids = self._check_ids(input_ids)
        B, T = ids.shape
        total = T + max_new_tokens
        if total - 1 > self.max_seq_len:
            raise ValueError(
                f"the prompt ({T} tokens) plus max_new_tokens ({max_new_tokens}) needs a cache of {total - 1} "
                f"tokens, longer than the engine's max_seq_len {self.max_seq_len}"
            )
        eos = None
        if eos_token_id is not None:
            eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                               dtype=torch.int64, device=self.device)
            pad = int(eos[0]) if pad_token_id is None else int(pad_token_id)
            finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        state = self._state_for(B, total - 1)
        logits = self.prefill(state, ids)
        out = []
        for i in range(max_new_tokens):
            nxt = _select(logits, do_sample, temperature, top_k, top_p, generator)
            if eos is not None:
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                finished |= torch.isin(nxt, eos)
            out.append(nxt)
            if i == max_new_tokens - 1 or (eos is not None and bool(finished.all())):
                break
            state.ids.copy_(nxt)
            logits = self._advance(state)
        if state.mlp_fused:  # a fused-MLP barrier that timed out invalidates the tokens: raise (one host sync)
            check_mlp_sync(state.mlp_sync)
        return torch.cat([ids, torch.stack(out, dim=1)], dim=1)

    # ------------------------------------------------------------------ tracing (parity)

    @torch.no_grad()
    def trace(self, input_ids, prefill_len: int | None = None) -> dict:
        """Every stage of every layer for the tokens input_ids [B, T]: the first ``prefill_len`` through
        prefill, the rest one decode step at a time (teacher forcing). Returns {name: [B, T, ...]}
        with names ``layers.<i>.<stage>`` (``STAGES``), ``final_norm`` and ``logits``."""
        ids = self._check_ids(input_ids)
        B, T = ids.shape
        P = T if prefill_len is None else int(prefill_len)
        if not 1 <= P <= T:
            raise ValueError(f"prefill_len must lie in [1, {T}], got {prefill_len!r}")
        state = self.new_state(B, T)
        pre: dict = {}
        self.prefill(state, ids[:, :P], trace=pre)
        steps = []
        for t in range(P, T):
            one: dict = {}
            self.step(state, ids[:, t], trace=one)
            steps.append(one)
        out = {}
        for name, first in pre.items():
            parts = [first] + [st[name][:, None] for st in steps]
            out[name] = torch.cat([p.reshape(B, p.shape[1], *first.shape[2:]) for p in parts], dim=1)
        return out


# ----------------------------------------------------------------------------- sampling


def _check_dtype(dtype):
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {[str(d).replace('torch.', '') for d in DTYPES]}, got {dtype}")
    return dtype


def _check_sampling(do_sample, temperature, top_k, top_p):
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")


def sample_logits(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from logits [B, V]: temperature, then top-k, then top-p (nucleus), as
    Hugging Face's TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper."""
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= 1 - top_p
        remove[..., -1] = False  # keep at least the most likely token
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _select(logits, do_sample, temperature, top_k, top_p, generator):
    if not do_sample:
        return torch.argmax(logits, dim=-1)
    return sample_logits(logits, temperature, top_k, top_p, generator)
