"""The one model spec: a frozen, validated description of an Olmo 3-style model.

Everything that decides the architecture lives here, so the JAX and the Torch
trainer cannot disagree on the model they build:

- reordered-norm blocks: h = x + RMSNorm(attn(x)); out = h + RMSNorm(mlp(h));
  no input norms, a final RMSNorm before the untied output head (``norm_placement="pre"``
  moves the two norms to the sublayer inputs, as OLMoE and Llama place them; ``"peri"`` keeps
  the output norms and adds an input norm to each sublayer, OLMo-core 3's use_peri_norm);
- optionally the embedding scaled (``embedding_scale``) and then RMS-normalised
  (``embedding_norm``), as OLMo-core 3's OLMoE3 models do (scale sqrt(d_model), then norm);
- QK-norm over the full projected width (Olmo 3) or per head; a head width of d_model / n_heads
  unless ``head_dim`` says otherwise;
- a per-layer attention kind: "sliding_attention" (window `sliding_window`) or
  "full_attention"; the Olmo 3 default is 3 sliding : 1 global (layer i is
  global when i % 4 == 3);
- RoPE (rotate-half), with optional YaRN applied to the global layers only;
- SwiGLU MLPs, or MoE blocks (routed SwiGLU experts + optional shared expert).

A bad spec is a one-line ``ValueError`` naming the field and the fix.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AttentionKind = Literal["sliding_attention", "full_attention"]
SLIDING: AttentionKind = "sliding_attention"
FULL: AttentionKind = "full_attention"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class YarnSpec(_Frozen):
    """YaRN RoPE scaling (Peng et al. 2023) as transformers implements it; Olmo 3 stage 3
    uses factor 8 over an original context of 8192 with beta_fast 32, beta_slow 1."""

    factor: float = Field(8.0, gt=1.0)  # context extension ratio
    original_max_position_embeddings: int = Field(8192, gt=0)  # pre-extension context
    beta_fast: float = Field(32.0, gt=0)  # high-frequency boundary (in rotations)
    beta_slow: float = Field(1.0, gt=0)  # low-frequency boundary (in rotations)
    # None: transformers' default 0.1 * ln(factor) + 1 scaling of cos/sin.
    attention_factor: float | None = None


class MoESpec(_Frozen):
    """Mixture-of-experts feed-forward blocks (OLMoE / Olmo-core 3 style)."""

    n_experts: int = Field(gt=0)  # routed experts per MoE layer
    top_k: int = Field(gt=0)  # experts each token is routed to
    expert_hidden: int = Field(gt=0)  # SwiGLU hidden size of one routed expert
    n_shared_experts: int = Field(0, ge=0)  # experts every token goes through
    shared_expert_hidden: int | None = None  # None: same as expert_hidden
    gating: Literal["softmax", "sigmoid"] = "softmax"  # router score function
    normalize_top_k: bool = False  # renormalise the chosen k weights to sum to 1
    # Then scale them by top_k, so that they sum to k (OLMo-core 3's MoERouterConfigV2
    # restore_weight_scale: the routed output keeps the scale of a dense MLP's).
    restore_weight_scale: bool = False
    load_balancing_loss_weight: float = Field(0.01, ge=0)  # Switch-style aux loss
    router_z_loss_weight: float = Field(0.001, ge=0)  # ST-MoE router z-loss
    # Which layers are MoE; None means every layer.
    layers: tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}; set top_k <= n_experts")
        if self.restore_weight_scale and not self.normalize_top_k:
            raise ValueError(
                "moe.restore_weight_scale scales the renormalised top-k weights by top_k; "
                "set moe.normalize_top_k: true as well, or restore_weight_scale: false"
            )
        return self

    @property
    def shared_hidden(self) -> int:
        return self.shared_expert_hidden or self.expert_hidden


class ModelSpec(_Frozen):
    """An Olmo 3-style decoder. Defaults are the Olmo 3 7B values (docs/design.md)."""

    name: str | None = None  # preset name, for logs only; does not affect the maths
    d_model: int = Field(4096, gt=0)
    n_layers: int = Field(32, gt=0)
    n_heads: int = Field(32, gt=0)
    n_kv_heads: int | None = None  # None: multi-head attention (= n_heads)
    # Width of one attention head; omitted: d_model // n_heads. OLMo-core 3's MoE configs set
    # it on its own (q width n_heads * head_dim = 3072 at d_model 2560 in OLMoE3-dev-s001).
    head_dim: int = Field(0, gt=0)
    mlp_hidden: int = Field(11008, gt=0)  # SwiGLU hidden size
    vocab_size: int = Field(100278, gt=0)  # dolma2 tokenizer
    padded_vocab_size: int = Field(100352, gt=0)  # vocab rounded up to a multiple of 128
    eos_token_id: int | None = 100257  # dolma2
    pad_token_id: int | None = 100277  # dolma2
    bos_token_id: int | None = None
    norm_eps: float = Field(1e-6, gt=0)  # RMSNorm eps
    qk_norm: Literal["full", "per_head", "none"] = "full"  # Olmo 3: full projected width
    # Where a block's two RMSNorms sit. reordered (Olmo 3): h = x + norm(attn(x)),
    # out = h + norm(mlp(h)); pre (OLMoE, Llama): h = x + attn(norm(x)), out = h + mlp(norm(h)).
    # The same two norm weights (post_attention_layernorm / post_feedforward_layernorm in our
    # HF names: the attention sublayer's norm and the MLP sublayer's) either way. peri (OLMo-core
    # 3's use_peri_norm): h = x + norm(attn(in_norm(x))), out = h + norm(mlp(in_norm'(h))), two
    # more weights per layer (input_layernorm and pre_feedforward_layernorm, Gemma 2's names).
    norm_placement: Literal["reordered", "pre", "peri"] = "reordered"
    # The embedding output times embedding_scale (null: 1), then, with embedding_norm, an RMSNorm
    # with its own weight (model.embed_norm): OLMo-core 3's embed_scale and embedding_norm.
    embedding_scale: float | None = Field(None, gt=0)
    embedding_norm: bool = False
    rope_theta: float = Field(500_000.0, gt=0)
    yarn: YarnSpec | None = None  # applied to full_attention layers only (Olmo 3 stage 3)
    sliding_window: int | None = 4096  # keys a sliding layer's query sees, itself included
    # One entry per layer; None derives Olmo 3's pattern (layer i global iff i % 4 == 3).
    layer_types: tuple[AttentionKind, ...] | None = None
    max_position_embeddings: int = Field(65536, gt=0)  # longest context the recipe uses
    init_std: float = Field(0.02, gt=0)  # truncated-normal std for linears and embedding
    init_cutoff: float = Field(3.0, gt=0)  # truncation at +-init_cutoff * init_std
    z_loss_weight: float = Field(1e-5, ge=0)  # weight of logsumexp(logits)^2
    moe: MoESpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _fill_head_dim(cls, data):
        if isinstance(data, dict) and data.get("head_dim") is None:
            d = data.get("d_model", cls.model_fields["d_model"].default)
            h = data.get("n_heads", cls.model_fields["n_heads"].default)
            if isinstance(d, int) and isinstance(h, int) and d > 0 and h > 0:
                if d % h:
                    raise ValueError(
                        f"n_heads={h} does not divide d_model={d}; "
                        "choose n_heads so that d_model % n_heads == 0, or set head_dim"
                    )
                data = {**data, "head_dim": d // h}
        return data

    @model_validator(mode="before")
    @classmethod
    def _fill_layer_types(cls, data):
        if isinstance(data, dict) and data.get("layer_types") is None:
            n = data.get("n_layers", cls.model_fields["n_layers"].default)
            window = data.get("sliding_window", cls.model_fields["sliding_window"].default)
            if isinstance(n, int) and n > 0:
                data = dict(data)
                data["layer_types"] = tuple(FULL if (window is None or i % 4 == 3) else SLIDING for i in range(n))
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}; "
                "set n_kv_heads to a divisor of n_heads"
            )
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}; "
                "set padded_vocab_size to vocab_size rounded up (Olmo 3 pads to a multiple of 128)"
            )
        for field in ("eos_token_id", "pad_token_id", "bos_token_id"):
            tok = getattr(self, field)
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"{field}={tok} is outside the vocabulary [0, {self.vocab_size}); "
                    f"set {field} to a token id below vocab_size or to null"
                )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"sliding_window={self.sliding_window} must be a positive number of keys; "
                "set sliding_window >= 1, or null for full attention on every layer"
            )
        assert self.layer_types is not None  # filled by _fill_layer_types
        if len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but n_layers={self.n_layers}; "
                "give one attention kind per layer, or omit layer_types for the 3:1 default"
            )
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "layer_types contains sliding_attention but sliding_window is null; "
                "set sliding_window or make every layer full_attention"
            )
        if self.yarn is not None and self.yarn.original_max_position_embeddings > self.max_position_embeddings:
            raise ValueError(
                f"yarn.original_max_position_embeddings={self.yarn.original_max_position_embeddings} "
                f"exceeds max_position_embeddings={self.max_position_embeddings}; "
                "raise max_position_embeddings to the extended context"
            )
        if self.moe is not None and self.moe.layers is not None:
            bad = [i for i in self.moe.layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(
                    f"moe.layers has indices {bad} outside [0, {self.n_layers}); "
                    "list layer indices below n_layers, or null for every layer"
                )
        return self

    # ---- derived sizes -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        if self.moe is None:
            return False
        return self.moe.layers is None or i in self.moe.layers

    def window_of(self, i: int) -> int | None:
        """Keys a query of layer i can see (itself included); None for global layers."""
        assert self.layer_types is not None  # filled by _fill_layer_types
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def rope_yarn_of(self, i: int) -> YarnSpec | None:
        """YaRN applies to the global layers only (Olmo 3 stage 3, transformers' rope_parameters)."""
        assert self.layer_types is not None  # filled by _fill_layer_types
        return self.yarn if self.layer_types[i] == FULL else None

    def replace(self, **changes) -> ModelSpec:
        """A new validated spec with some fields changed (layer_types re-derived unless given; head_dim
        too, on a change of d_model or n_heads, where it was d_model / n_heads)."""
        data = self.model_dump()
        if "layer_types" not in changes and ("n_layers" in changes or "sliding_window" in changes):
            data["layer_types"] = None
        derived_head_dim = self.head_dim * self.n_heads == self.d_model
        if "head_dim" not in changes and derived_head_dim and ("d_model" in changes or "n_heads" in changes):
            data["head_dim"] = None
        data.update(changes)
        return ModelSpec.model_validate(data)
