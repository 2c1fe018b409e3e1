"""The config-driven description of a decoder-only transformer: every native family is the same decoder
block with a few switches (norms and where they sit, positions, parallel residual, MLP kind, GQA, q/k
norms, soft-capping, sliding windows, biases). A family module turns a ``config.json`` dict into a
:class:`DecoderSpec` (pipeline.models.families).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding: which dims rotate and how inv_freq is built."""

    theta: float = 10000.0
    rotary_dim: int = 0  # number of leading head dims that rotate (even); head_dim for full rotary
    interleaved: bool = False  # GPT-J rotates (x0,x1),(x2,x3)...; NeoX/Llama rotate halves
    scaling_type: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    # longrope (Phi-3.5/4): per-dim divisors for rows no longer than original_max_position (short)
    # and longer (long); cos/sin are multiplied by attention_factor
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` gated (SwiGLU) experts per token.

    Layer ``i`` is sparse when ``i not in mlp_only_layers and (i + 1) % sparse_step == 0``
    (Qwen2/3-MoE's ``decoder_sparse_step``); other layers keep the dense MLP of ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    expert_size: int  # intermediate width of one expert
    norm_topk_prob: bool = True  # renormalize the chosen probabilities to sum to 1 (Mixtral always)
    fp32_weights: bool = False  # Mixtral keeps routing weights in float32; Qwen casts them to the hidden dtype
    shared_expert_size: int = 0  # Qwen2-MoE: an always-on expert scaled by sigmoid(shared_expert_gate(x))
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        """Whether global layer ``layer`` routes through experts (else it has the dense MLP)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")


@dataclass(frozen=True)
class DecoderSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm: str = "rms"  # rms | layer
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # Gemma: rms norms scale by (1 + weight)
    norm_scale_fp32: bool = False  # rms: multiply by the weight in float32, then cast (Gemma, OLMo 2)
    position: str = "rope"  # rope | learned | alibi
    rope: RopeSpec | None = None
    learned_pos_offset: int = 0  # OPT's learned positions start at index 2
    mlp: str = "gated"  # gated (SwiGLU: down(act(gate) * up)) | plain (fc2(act(fc1)))
    activation: str = "silu"  # silu | gelu | gelu_tanh | relu
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False  # layer norms with bias (LayerNorm); rms norms have none
    pre_norm: bool = True  # norms on the branch inputs; False without post_branch_norm: OPT-350m post-norm
    post_branch_norm: bool = False  # norms on the attention / MLP outputs before the residual add (Gemma 2/3, OLMo 2)
    qk_norm: str = ""  # "" | head (per head over head_dim: Qwen3, Gemma 3) | full (over the projection: OLMo 2)
    attn_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # Gemma 2: scores -> cap * tanh(scores / cap); 0: off
    final_softcap: float = 0.0  # Gemma 2: logits -> cap * tanh(logits / cap); 0: off
    embed_scale: float = 0.0  # Gemma: embeddings times sqrt(hidden_size) (in the weights' dtype); 0: off
    sliding_window: int = 0  # keys a sliding layer's query sees (itself included)
    layer_kinds: tuple[str, ...] = ()  # per global layer: "full" or "sliding"; empty: all full
    local_rope: RopeSpec | None = None  # rotary of the sliding layers when it differs (Gemma 3)
    parallel_residual: bool = False  # x + attn(n1(x)) + mlp(n2(x))
    shared_norm: bool = False  # parallel residual with one norm for both branches (GPT-J, Falcon-7b)
    embed_norm: bool = False  # BLOOM: layer norm right after the word embedding
    final_norm: bool = True
    embed_dim: int = 0  # OPT-350m: embeddings of size embed_dim, projected in/out of hidden_size
    lm_head_bias: bool = False  # GPT-J
    tie_embeddings: bool = False
    moe: MoESpec | None = None  # mixture-of-experts MLP on the layers moe.sparse(i) selects
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and bool(self.layer_kinds) and self.layer_kinds[layer] == "sliding"

    @property
    def word_dim(self) -> int:
        """Width of the word embedding table (differs from hidden_size only with a projection)."""
        return self.embed_dim or self.hidden_size

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert self.position in ("rope", "learned", "alibi"), self.position
        assert self.position != "rope" or self.rope is not None
        assert self.qk_norm in ("", "head", "full"), self.qk_norm
        assert not self.layer_kinds or len(self.layer_kinds) == self.num_layers, "one layer kind per layer"
        assert set(self.layer_kinds) <= {"full", "sliding"}, self.layer_kinds
