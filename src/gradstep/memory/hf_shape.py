"""The shape of a Hugging Face decoder-only causal LM, read from its config.

:class:`HFShape` is to an ``AutoModelForCausalLM`` what
:class:`~gradstep.memory.TransformerShape` is to the demo GPT: the dimensions the memory
model needs, before anything is allocated. It lists every parameter tensor the model holds
(names, shapes, and whether it trains: LoRA freezes the base and adds two small matrices
per targeted linear), so parameters, gradients and optimizer state are counted exactly; its
activation terms are in :mod:`gradstep.memory.hf_activations`, and
:func:`gradstep.memory.hf_config.from_hf_config` reads one from a model's config.

Families (``config.model_type``) and how they differ, read from transformers 5's modelling
code: ``llama``, ``mistral``, ``qwen2`` (biased q/k/v), ``qwen3`` (per-head q/k norms) are
pre-norm RMSNorm blocks with separate q/k/v/o projections and a gated (SwiGLU) MLP;
``phi3`` fuses q/k/v and gate/up; ``gpt_neox`` has LayerNorms, a fused biased q/k/v,
partial rotary, a GELU MLP and parallel residual branches; ``opt`` has LayerNorms,
learned positions (two offset rows), a ReLU MLP and dropout on the residual branches;
``qwen2_moe`` and ``olmoe`` (full-width q/k norms) replace the MLP by ``num_experts``
experts stored as 3-D tensors, ``num_experts_per_tok`` of them per token, behind a router
(``qwen2_moe``: plus a gated shared expert). Nothing here imports transformers: the config
is only read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALL_LINEAR", "FAMILIES", "HFShape", "Linear"]

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = (*LLAMA_LIKE, "phi3", "gpt_neox", "opt", "qwen2_moe", "olmoe")
"""``model_type`` values the memory model knows (others:
:func:`gradstep.memory.hf_config.from_hf_config` raises)."""
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` of a block: its name inside the block, shape and what it reads.

    ``reads``: the activation it takes as input: ``attn_in`` (the attention norm's output),
    ``attn_out`` (the attention core's output), ``mlp_in`` (the MLP norm's output),
    ``mlp_hidden`` (the MLP's hidden activation), ``shared_hidden`` (the shared expert's).
    """

    name: str
    out_features: int
    in_features: int
    bias: bool
    reads: str


@dataclass(frozen=True)
class HFShape:
    """Dimensions of an HF decoder-only causal LM (see the module docstring)."""

    family: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab_size: int
    seq_len: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rotary_dim: int = 0
    """Dimensions of each head that RoPE rotates (0: learned positions)."""
    positions: int = 0
    """Rows of a learned position table (OPT: ``max_position_embeddings + 2``), else 0."""
    dropout: float = 0.0
    """Dropout on the residual branches (OPT's ``dropout``), active in training."""
    experts: int = 0
    top_k: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    dense_layers: tuple[int, ...] = ()
    """MoE models: layers that keep a dense MLP (``mlp_only_layers``, sparse step)."""
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    """Names (PEFT's rule: a module matches when its path ends with ``.NAME``), or
    ``("all-linear",)``: every ``nn.Linear`` but the output head."""
    lora_dropout: float = 0.0
    expert_lora: tuple[int, int, int] = (0, 0, 0)
    """Adapters PEFT puts on a MoE's 3-D expert tensors and router, as rank multiples of
    ``lora_rank`` (gate_up, down, router): PEFT converts the per-expert module names of
    families transformers fused (OLMoE) into these, a gate_up adapter holding one rank per
    matched name (gate_proj, up_proj). See :func:`_expert_lora`."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("n_layer", "d_model", "n_head", "n_kv_head", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"HFShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 1:
            raise ValueError(f"HFShape.seq_len must be >= 1, got {self.seq_len}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..experts ({self.experts}), got {self.top_k}")

    # -- structure ------------------------------------------------------------------------

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def norm(self) -> str:
        """``rms`` (HF's RMSNorm: float32 inside) or ``layer`` (LayerNorm with a bias)."""
        return "layer" if self.family in ("gpt_neox", "opt") else "rms"

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    def attention_linears(self) -> list[Linear]:
        d, q, kv, bias = self.d_model, self.q_width, self.kv_width, self.qkv_bias
        if self.family == "phi3":
            return [
                Linear("self_attn.qkv_proj", q + 2 * kv, d, bias, "attn_in"),
                Linear("self_attn.o_proj", d, q, self.o_bias, "attn_out"),
            ]
        if self.family == "gpt_neox":
            return [
                Linear("attention.query_key_value", q + 2 * kv, d, bias, "attn_in"),
                Linear("attention.dense", d, q, self.o_bias, "attn_out"),
            ]
        out = "out_proj" if self.family == "opt" else "o_proj"
        return [
            Linear("self_attn.q_proj", q, d, bias, "attn_in"),
            Linear("self_attn.k_proj", kv, d, bias, "attn_in"),
            Linear("self_attn.v_proj", kv, d, bias, "attn_in"),
            Linear(f"self_attn.{out}", d, q, self.o_bias, "attn_out"),
        ]

    def mlp_linears(self, layer: int) -> list[Linear]:
        d, f, bias = self.d_model, self.d_ff, self.mlp_bias
        if self.family == "phi3":
            return [
                Linear("mlp.gate_up_proj", 2 * f, d, bias, "mlp_in"),
                Linear("mlp.down_proj", d, f, bias, "mlp_hidden"),
            ]
        if self.family == "gpt_neox":
            return [
                Linear("mlp.dense_h_to_4h", f, d, bias, "mlp_in"),
                Linear("mlp.dense_4h_to_h", d, f, bias, "mlp_hidden"),
            ]
        if self.family == "opt":
            return [Linear("fc1", f, d, bias, "mlp_in"), Linear("fc2", d, f, bias, "mlp_hidden")]
        if not self.is_moe(layer):
            return _gated("mlp", d, f, bias, "mlp_hidden")
        if not self.shared_ff:
            return []
        shared = _gated("mlp.shared_expert", d, self.shared_ff, False, "shared_hidden")
        return [*shared, Linear("mlp.shared_expert_gate", 1, d, False, "mlp_in")]

    def linears(self, layer: int) -> list[Linear]:
        return self.attention_linears() + self.mlp_linears(layer)

    def targeted(self, linear: Linear | str) -> bool:
        """Whether LoRA puts an adapter on ``linear`` (a block linear, or ``"lm_head"``).

        PEFT's rule: a target names a module by its full path or a dotted suffix of it
        (``q_proj``); a resolved full path (``model.layers.0.self_attn.q_proj``, as PEFT
        stores ``all-linear``) matches the linear of that name in every layer.
        """
        if not self.lora:
            return False
        name = linear if isinstance(linear, str) else linear.name
        if ALL_LINEAR in self.lora_targets:
            return name != "lm_head"
        path = "." + name
        return any(path.endswith("." + t) or ("." + t).endswith(path) for t in self.lora_targets)

    def norm_widths(self) -> list[tuple[str, int]]:
        """Norms of one block: (kind, width); ``qk`` norms act on q and k."""
        d = self.d_model
        widths = [("block", d), ("block", d)]
        if self.family == "olmoe":
            widths += [("qk", self.q_width), ("qk", self.kv_width)]
        if self.family == "qwen3":
            widths += [("qk", self.head_dim), ("qk", self.head_dim)]
        return widths

    # -- parameters -----------------------------------------------------------------------

    def layer_tensors(self, layer: int) -> list[tuple[tuple[int, ...], bool]]:
        """Parameter tensors of block ``layer``: (shape, trains?)."""
        train = not self.lora
        out: list[tuple[tuple[int, ...], bool]] = []
        for lin in self.linears(layer):
            out.append(((lin.out_features, lin.in_features), train))
            if lin.bias:
                out.append(((lin.out_features,), train))
            if self.targeted(lin):
                out += [((self.lora_rank, lin.in_features), True)]
                out += [((lin.out_features, self.lora_rank), True)]
        per_norm = 2 if self.norm == "layer" else 1
        out += [((w,), train) for _, w in self.norm_widths() for _ in range(per_norm)]
        if self.is_moe(layer):
            d, e, fe = self.d_model, self.experts, self.expert_ff
            out += [((e, d), train), ((e, 2 * fe, d), train), ((e, d, fe), train)]
            out += self._expert_adapters()
        return out

    def _expert_adapters(self) -> list[tuple[tuple[int, ...], bool]]:
        """PEFT's adapters on the 3-D expert tensors (``A (rank*E, in)``, ``B (out,
        rank*E)``) and on the router (``A (r, d)``, ``B (E, r)``)."""
        d, e, fe, r = self.d_model, self.experts, self.expert_ff, self.lora_rank
        gate_up, down, router = (k * r for k in self.expert_lora)
        out = []
        if gate_up:
            out += [((gate_up * e, d), True), ((2 * fe, gate_up * e), True)]
        if down:
            out += [((down * e, fe), True), ((d, down * e), True)]
        if router:
            out += [((router, d), True), ((e, router), True)]
        return out

    def other_tensors(self) -> list[tuple[int, ...]]:
        """Shapes outside the blocks: embedding, position table, final norm, untied head."""
        return [s for s, _ in self._other()]

    def _other(self) -> list[tuple[tuple[int, ...], bool]]:
        train, v, d = not self.lora, self.vocab_size, self.d_model
        out = [((v, d), train)]
        if self.positions:
            out.append(((self.positions, d), train))
        out += [((d,), train)] * (2 if self.norm == "layer" else 1)
        if not self.tied_embeddings:
            out.append(((v, d), train))
        if self.targeted("lm_head"):
            out += [((self.lora_rank, d), True), ((v, self.lora_rank), True)]
        return out

    def all_tensors(self) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape (a tied head once)."""
        return [s for s, _ in self._all()]

    def trainable_tensors(self) -> list[tuple[int, ...]]:
        return [s for s, train in self._all() if train]

    def _all(self) -> list[tuple[tuple[int, ...], bool]]:
        layers = [t for i in range(self.n_layer) for t in self.layer_tensors(i)]
        return layers + self._other()

    def block_tensors(self) -> list[tuple[int, ...]]:
        """The largest block's parameter shapes (what FSDP2 all-gathers at once)."""
        return [s for s, _ in self.layer_tensors(self._largest_layer())]

    def head_and_block_trainable(self) -> list[tuple[int, ...]]:
        """Trainable tensors outside the blocks and in the largest block: the gradients
        that exist when a recomputed top block's backward peaks (checkpointing)."""
        block = self.layer_tensors(self._largest_layer())
        return [s for s, train in [*self._other(), *block] if train]

    def _largest_layer(self) -> int:
        sizes = [_numel([s for s, _ in self.layer_tensors(i)]) for i in range(self.n_layer)]
        return max(range(self.n_layer), key=sizes.__getitem__)

    @property
    def block_params(self) -> int:
        return _numel(self.block_tensors())

    @property
    def params(self) -> int:
        """Unique parameters, a tied head counted once, LoRA's adapters included."""
        return _numel(self.all_tensors())

    @property
    def trainable_params(self) -> int:
        return _numel(self.trainable_tensors())

    def matmul_numel(self, blocks: int | None = None, part: str = "all") -> int:
        """Weights autocast casts for a matmul and the graph keeps: ``blocks`` blocks'
        linears (and adapters), the routers, and the head (grouped-mm experts are not
        autocast: no copies). Under LoRA a frozen linear whose input needs no gradient
        keeps no copy: the first layer's attention projections (and GPT-NeoX's MLP when no
        adapter is on it), whose input is the frozen embedding's output. ``part``: ``base``
        or ``adapters`` only (they may be held in different dtypes), or ``all``."""
        count = self.n_layer if blocks is None else blocks
        base = adapters = 0
        for layer in range(count):
            for lin in self.linears(layer):
                # A weight's copy serves its input's gradient: none wanted, none kept.
                frozen_input = blocks is None and layer == 0 and self._no_input_grad(lin)
                base += 0 if frozen_input else lin.out_features * lin.in_features
                if self.targeted(lin):
                    a_in = 0 if frozen_input else lin.in_features
                    adapters += self.lora_rank * (a_in + lin.out_features)
            if self.is_moe(layer):
                base += self.experts * self.d_model
                adapters += sum(math.prod(t) for t, _ in self._expert_adapters())
        base += self.vocab_size * self.d_model
        if self.targeted("lm_head"):
            adapters += self.lora_rank * (self.d_model + self.vocab_size)
        return {"base": base, "adapters": adapters}.get(part, base + adapters)

    def _no_input_grad(self, lin: Linear) -> bool:
        """Under LoRA, a first-layer linear that reads the frozen embedding's output."""
        if not self.lora:
            return False
        if lin.reads == "attn_in":
            return True
        mlp = self.mlp_linears(0)
        return self.family == "gpt_neox" and not any(self.targeted(m) for m in mlp)


def _gated(prefix: str, d: int, f: int, bias: bool, hidden: str) -> list[Linear]:
    return [
        Linear(f"{prefix}.gate_proj", f, d, bias, "mlp_in"),
        Linear(f"{prefix}.up_proj", f, d, bias, "mlp_in"),
        Linear(f"{prefix}.down_proj", d, f, bias, hidden),
    ]


def _numel(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)
