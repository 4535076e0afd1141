"""DeepSeek-V4: sliding/CSA/HCA attention, mHC residual streams, hash-routed and sqrtsoftplus-routed MoE.

The residual is ``hc_mult`` parallel streams (``[T, hc, H]``). Around each sublayer a hyper-connection
collapses them into the sublayer's input (``pre`` weights), places the output back into every stream
(``post``) and mixes the streams with a Sinkhorn-projected doubly-stochastic matrix (``comb``); a
hyper-head collapses them once more before the final norm. Parameter names follow the DeepSeek
release checkpoint; :meth:`DeepseekV4ForCausalLM.map_checkpoint_name` also accepts transformers'
names (in memory and as ``save_pretrained`` writes them). A decode step (one token per sequence) runs
as segments, CUDA graphs on CUDA, around the per-sequence attention and the expert dispatch
(:mod:`deepseek_v4_step`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.kernels import v4_router
from moetier.kernels.hyper_mix import (
    Merge,
    Mixed,
    Mixing,
    collapse_reference,
    hyper_mix,
    merge_reference,
    weights_reference,
)
from moetier.kernels.swiglu import swiglu
from moetier.models.base import (
    CausalLM,
    ExpertTarget,
    ForwardBatch,
    IgnoreTarget,
    ParamTarget,
    WeightTarget,
    register_model,
)
from moetier.models.deepseek_v4_attention import (
    DeepseekV4Attention,
    FusedLinears,
    Projections,
    V4RMSNorm,
)
from moetier.models.deepseek_v4_cache import CompressorState, DeepseekV4Cache, LayerCache, SlidingWindowKV
from moetier.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from moetier.models.deepseek_v4_rope import ROPE_KINDS, RotaryTable, Rotation, StepRope, rotation_tensors
from moetier.models.deepseek_v4_step import carry_merge, decode_step
from moetier.models.graph_segments import SegmentGraphs
from moetier.models.layers import DenseMLP, rope_inverse_frequencies
from moetier.tiers.dispatcher import ExpertDispatcher
from moetier.tiers.experts import ExpertLayout


class HyperConnection(nn.Module):
    """mHC around one sublayer: ``fn``/``base``/``scale`` give ``pre``, ``post`` and ``comb`` (in float32)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = (
            cfg.hc_mult,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
        mix = (2 + self.hc) * self.hc
        self.fn = nn.Parameter(torch.empty(mix, self.hc * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty(mix))
        self.scale = nn.Parameter(torch.empty(3))

    @property
    def mixing(self) -> Mixing:
        return Mixing(self.fn, self.base, self.scale, self.hc, self.iters, self.hc_eps, self.norm_eps)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams`` ``[T, hc, H]`` -> ``post`` ``[T, hc]``, ``comb`` ``[T, hc, hc]``, sublayer input ``[T, H]``."""
        pre, post, comb = weights_reference(streams, self.mixing)
        return post, comb, collapse_reference(streams, pre)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Only the sublayer input of :meth:`forward` (``post`` and the Sinkhorn ``comb`` skipped), the same numbers."""
        pre, _, _ = weights_reference(streams, self.mixing, pre_only=True)
        return collapse_reference(streams, pre)

    def mix(self, streams: torch.Tensor, norm: V4RMSNorm, merge: Merge | None = None) -> Mixed:
        """:meth:`forward` then ``norm`` of the sublayer input, with ``merge`` (a sublayer's output merged into the
        streams first) where given: the two mHC kernels on CUDA (:mod:`moetier.kernels.hyper_mix`)."""
        return hyper_mix(streams, self.mixing, norm.weight, norm.eps, merge)

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams: ``post[k] * out + sum_j comb[j, k] * streams[j]`` (``comb`` is applied transposed)."""
        return merge_reference(streams, Merge(post, comb, out))


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden state (sigmoid weights, no mixing)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.hc, self.hc_eps, self.norm_eps = cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty(cfg.hc_mult))
        self.scale = nn.Parameter(torch.empty(1))

    @property
    def mixing(self) -> Mixing:
        return Mixing(self.fn, self.base, self.scale, self.hc, 0, self.hc_eps, self.norm_eps)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        pre, _, _ = weights_reference(streams, self.mixing)
        return collapse_reference(streams, pre)

    def mix(self, streams: torch.Tensor, norm: V4RMSNorm, merge: Merge | None = None) -> torch.Tensor:
        """``norm(self(streams))`` (``merge``: the last layer's MoE output merged in first), in two kernels on CUDA."""
        return hyper_mix(streams, self.mixing, norm.weight, norm.eps, merge).x


_SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


class Router(nn.Module):
    """Scores every expert; picks top-k of ``score + bias`` (``bias``: the load-balancing correction) or,
    when ``hashed``, the fixed ``tid2eid[token]`` experts. Weights are the picked scores, renormalised
    and times ``routed_scaling_factor``. Routing runs in float32: for decode-sized batches on CUDA in two
    Triton kernels (:mod:`moetier.kernels.v4_router`; learned ids in descending ``score + bias``), else the torch ops
    (:meth:`_forward_torch`)."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k, self.scoring = hashed, cfg.num_experts_per_tok, cfg.scoring_func
        self.score_fn, self.scaling = _SCORE_FUNCS[cfg.scoring_func], cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias, table = (None, self.tid2eid) if self.hashed else (self.bias, None)
        return v4_router.route(x, self.weight, bias, table, input_ids, self.top_k, self.scaling, self.scoring,
                               lambda: self._forward_torch(x, input_ids))  # fmt: skip

    def _forward_torch(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self._scores(x)
        ids = self._pick(scores, input_ids)
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return ids, weights.to(x.dtype)

    def select(self, x: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        """The expert ids ``[T, k]`` (int64) :meth:`forward` picks, without their weights; a hashed router
        reads only ``input_ids`` (``x`` may be None)."""
        if self.hashed:
            return self._pick(None, input_ids)
        return v4_router.select(x, self.weight, self.bias, self.top_k, self.scoring,
                                lambda: self._pick(self._scores(x), input_ids))  # fmt: skip

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.score_fn(F.linear(x.float(), self.weight.float()))

    def _pick(self, scores: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        if self.hashed:
            return self.tid2eid[input_ids].long()
        return torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices


class SharedExpert(DenseMLP):
    """The shared expert: :class:`DenseMLP` whose gate and up projections run as one GEMM once fused."""

    def __init__(self, hidden: int, inter: int, swiglu_limit: float | None) -> None:
        super().__init__(hidden, inter, swiglu_limit)
        self.gate_up = FusedLinears([[self.gate_proj], [self.up_proj]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # views of one GEMM's output, read in place by the fused SwiGLU
        return self.down_proj(swiglu(gate, up, self.swiglu_limit))


class DeepseekV4MoE(nn.Module):
    """Routed experts (through the dispatcher) plus the shared expert, both with the clamped SwiGLU."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg, hashed=cfg.mlp_layer_types[layer] == "hash_moe")
        self.shared_experts: SharedExpert | None = None
        if cfg.n_shared_experts:
            width = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.shared_experts = SharedExpert(cfg.hidden_size, width, cfg.swiglu_limit)
        object.__setattr__(self, "dispatcher", dispatcher)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, input_ids)
        out = self.dispatcher.dispatch(self.layer, x, ids, weights)
        return self.add_shared(out, self.shared(x))

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output (None without one)."""
        return None if self.shared_experts is None else self.shared_experts(x)

    @staticmethod
    def add_shared(routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The block's output: the routed experts' sum plus the shared expert's output."""
        return routed if shared is None else routed + shared


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        self.attn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)
        self.layer = layer
        self.attn = DeepseekV4Attention(cfg, layer)
        self.ffn = DeepseekV4MoE(cfg, layer, dispatcher)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, rope: StepRope, batch: ForwardBatch
    ) -> torch.Tensor:
        """``rope`` covers every row of ``batch``; attention handles the sequences itself."""
        post, comb, x = self.attn_input(streams)
        sequences = [(s.rows, s.cache.layers[self.layer]) for s in batch.slices]
        streams = HyperConnection.merge(streams, self.attn(x, rope, sequences), post, comb)
        post, comb, x = self.ffn_input(streams)
        return HyperConnection.merge(streams, self.ffn(x, input_ids), post, comb)

    def attn_input(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``post``, ``comb`` and the normed attention input of ``streams``."""
        post, comb, x = self.attn_hc(streams)
        return post, comb, self.attn_norm(x)

    def ffn_input(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``post``, ``comb`` and the normed MoE input of ``streams``."""
        post, comb, x = self.ffn_hc(streams)
        return post, comb, self.ffn_norm(x)

    # The decode step's segments (:mod:`deepseek_v4_step`): the parts of the layer without per-sequence
    # state or host decisions, captured as CUDA graphs on CUDA; the one-call forward above is the same math.

    def decode_pre(
        self, carry: tuple[torch.Tensor | None, ...], token: dict[str, Rotation]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Projections]:
        """Before the attention of one token per sequence, from the previous layer's carry (:func:`carry_merge`:
        its MoE output merged in here): the streams, ``post``, ``comb``, the rotated queries (the attention's and
        the indexer's) and the projections of the normed input."""
        streams, merge = carry_merge(carry)
        mixed = self.attn_hc.mix(streams, self.attn_norm, merge)
        inputs = self.attn.project(mixed.x, token[self.attn.rope_kind])
        q, index_q = self.attn.decode_queries(inputs.q_residual, token)
        return mixed.streams, mixed.post, mixed.comb, q, index_q, inputs

    def decode_post(
        self,
        out: torch.Tensor,
        token: dict[str, Rotation],
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        input_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """After the attention (``out``, still rotated): the streams with the attention merged in, the MoE's
        ``post``, ``comb`` and normed input ``x`` and the routing (ids, weights). The routed experts come next,
        from the dispatcher, and the shared expert (``self.ffn.shared(x)``), which may run beside them."""
        attended = self.attn.decode_output(out, token[self.attn.rope_kind])
        mixed = self.ffn_hc.mix(streams, self.ffn_norm, Merge(post, comb, attended))
        ids, weights = self.ffn.gate(mixed.x, input_ids)
        return mixed.streams, mixed.post, mixed.comb, mixed.x, ids, weights

    def predict_routing(
        self,
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        shared: torch.Tensor | None,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """This layer's expert ids ``[B, k]`` predicted at the previous layer's dispatch, from that layer's
        :meth:`decode_post` outputs (``streams``, its MoE's ``post`` and ``comb``, its shared expert's output).
        Hash-routed: exact. Learned: this layer's MoE input estimated as this layer's ``ffn_hc`` collapse and
        ``ffn_norm`` of the previous layer's output streams with only the routed experts' part left out (the
        one part not computed yet; this layer's attention is skipped, as the pre-norm predictor skips it), then
        this router's selection, bias included. Capturable."""
        gate = self.ffn.gate
        if gate.hashed:
            return gate.select(None, input_ids)
        estimate = self.ffn_hc.mix(streams, self.ffn_norm, Merge(post, comb, shared))  # routed: zero
        return gate.select(estimate.x, input_ids)

    @staticmethod
    def finish_ffn(
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        routed: torch.Tensor,
        shared: torch.Tensor | None,
    ) -> torch.Tensor:
        """The layer's output streams once the routed experts' output is in (the end of :meth:`forward`)."""
        return HyperConnection.merge(streams, DeepseekV4MoE.add_shared(routed, shared), post, comb)


_COMPRESSOR_LEAF = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}
_INDEXER_LEAF = {"wq_b": "q_b_proj", "weights_proj": "scorer.weights_proj"}
_ATTN_LEAF = {
    "wq_a": "q_a_proj",
    "q_norm": "q_a_norm",
    "wq_b": "q_b_proj",
    "wkv": "kv_proj",
    "kv_norm": "kv_norm",
    "wo_a": "o_a_proj",
    "wo_b": "o_b_proj",
    "attn_sink": "sinks",
}
Rule = tuple[str, Any]
# Our (= release) name after "layers.N." -> transformers' in-memory name; the first matching rule applies.
_TO_TRANSFORMERS: list[Rule] = [
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^attn\.indexer\.compressor\.(\w+)", lambda m: f"self_attn.compressor.indexer.{_COMPRESSOR_LEAF[m[1]]}"),
    (r"^attn\.indexer\.(\w+)", lambda m: f"self_attn.compressor.indexer.{_INDEXER_LEAF[m[1]]}"),
    (r"^attn\.compressor\.(\w+)", lambda m: f"self_attn.compressor.{_COMPRESSOR_LEAF[m[1]]}"),
    (r"^attn\.(\w+)", lambda m: f"self_attn.{_ATTN_LEAF[m[1]]}"),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.", "mlp."),
]
# Our name -> the release's, where our modules name things differently.
_TO_RELEASE: list[Rule] = [
    (r"^(attn|ffn)_hc\.(fn|base|scale)$", r"hc_\1_\2"),
    (r"^ffn\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
    (r"^ffn\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
    (r"^ffn\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
]
_TOP_LEVEL_ALIASES = {
    "embed.weight": ["embed_tokens.weight"],
    "head.weight": ["lm_head.weight"],
    "hc_head.fn": ["hc_head_fn", "hc_head.hc_fn"],
    "hc_head.base": ["hc_head_base", "hc_head.hc_base"],
    "hc_head.scale": ["hc_head_scale", "hc_head.hc_scale"],
}
_RELEASE_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_HF_EXPERT = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_up_proj|down_proj|gate_proj|up_proj)(?:\.weight)?$"
)
_HASH_BIAS = re.compile(r"^layers\.(\d+)\.(?:ffn\.gate\.bias|mlp\.gate\.e_score_correction_bias)$")
_EXPERT_PART = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "gate_up_proj": "gate_up",
}


def _rewrite(name: str, rules: list[Rule]) -> str:
    for pattern, replacement in rules:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name, count=1)
    return name


def checkpoint_aliases(ours: str) -> set[str]:
    """Every checkpoint spelling (``model.`` prefix stripped) of our parameter ``ours``."""
    if ours in _TOP_LEVEL_ALIASES:
        return {ours, *_TOP_LEVEL_ALIASES[ours]}
    match = re.match(r"^(layers\.\d+\.)(.+)$", ours)
    if match is None:
        return {ours}
    prefix, rest = match.groups()
    forms = {rest, _rewrite(rest, _TO_RELEASE), _rewrite(rest, _TO_TRANSFORMERS)}
    if rest == "attn.kv_norm.weight":
        forms.add("attn.norm.weight")  # transformers' save_pretrained reverses its rename to this spelling
    return {prefix + form for form in forms}


@register_model("DeepseekV4ForCausalLM")
class DeepseekV4ForCausalLM(CausalLM):
    """DeepSeek-V4 (V4-Flash, V4-Pro)."""

    # As transformers' ``_keep_in_fp32_modules_strict``: mHC mixers, sinks, pooling biases, router bias, norms.
    keep_fp32 = ("attn_hc.", "ffn_hc.", "hc_head.", "attn_sink", ".ape", "gate.bias", "norm")
    # Decode steps (one token per sequence) run as segments (:mod:`deepseek_v4_step`), CUDA graphs where
    # ``graphs`` allows; False runs them through the layers' one-call forward, as prefill does.
    segmented_decode = True
    # A layer's decode graph reads its sequences' contiguous caches in place, so it is keyed by them (deepseek_v4_step).
    decode_graphs_read_caches = True

    def __init__(self, config: DeepseekV4Config, dispatcher: ExpertDispatcher) -> None:
        super().__init__(config, dispatcher)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, i, dispatcher) for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._aliases: dict[str, str] | None = None
        self.graphs = SegmentGraphs()

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> DeepseekV4Config:
        return DeepseekV4Config.from_hf(hf)

    @classmethod
    def expert_layout(cls, config: DeepseekV4Config) -> ExpertLayout:
        return ExpertLayout(
            moe_layers=tuple(range(config.num_hidden_layers)),
            num_experts=config.n_routed_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            top_k=config.num_experts_per_tok,
            swiglu_limit=config.swiglu_limit,
        )

    def map_checkpoint_name(self, name: str) -> WeightTarget:
        name = name.removeprefix("model.")
        if name.startswith("mtp."):
            return IgnoreTarget("multi-token-prediction layer")
        if self._is_hash_layer_bias(name):
            return IgnoreTarget("hash-routed layers pick experts by token id, without a score bias")
        for pattern in (_RELEASE_EXPERT, _HF_EXPERT):
            match = pattern.match(name)
            if match:
                layer, expert, part = match.groups()
                return ExpertTarget(int(layer), None if expert is None else int(expert), _EXPERT_PART[part])
        return ParamTarget(self._alias_table()[name])  # KeyError for a name we do not know

    def _is_hash_layer_bias(self, name: str) -> bool:
        match = _HASH_BIAS.match(name)
        layer = int(match[1]) if match else self.config.num_hidden_layers
        return layer < self.config.num_hidden_layers and self.config.mlp_layer_types[layer] == "hash_moe"

    def _alias_table(self) -> dict[str, str]:
        if self._aliases is None:
            table: dict[str, str] = {}
            names = [n for n, _ in self.named_parameters()] + [n for n, _ in self.named_buffers()]
            for ours in names:
                for alias in checkpoint_aliases(ours):
                    if table.setdefault(alias, ours) != ours:
                        raise RuntimeError(f"checkpoint name {alias} is ambiguous ({table[alias]} or {ours})")
            self._aliases = table
        return self._aliases

    def tied_parameters(self) -> dict[str, str]:
        return {"head.weight": "embed.weight"} if self.config.tie_word_embeddings else {}

    def post_load(self) -> None:
        cfg = self.config
        self.rope_tables: dict[str, RotaryTable] = {}
        for kind, params in zip(ROPE_KINDS, (cfg.main_rope, cfg.compress_rope), strict=True):
            inv_freq, factor = rope_inverse_frequencies(
                cfg.rope_head_dim, float(params["rope_theta"]), params, cfg.max_position_embeddings
            )
            self.rope_tables[kind] = RotaryTable(inv_freq.to(self.device), factor)
        for layer in self.layers:  # fewer, larger GEMMs per step (weights become views of one tensor each)
            layer.attn.fuse_projections()
            if layer.ffn.shared_experts is not None:
                layer.ffn.shared_experts.gate_up.fuse()
        # Graphs read the weights in place: any captured before (e.g. of an earlier load) are stale.
        self.graphs = SegmentGraphs()

    def new_cache(self, max_tokens: int, kv_dtype: str | None = None) -> DeepseekV4Cache:
        """``kv_dtype`` applies to the compressed entries (they grow with the context); the sliding
        window and the compressors' rolling state are bounded and stay in the model dtype."""
        cfg, dtype, device = self.config, self.dtype, self.device
        layers = []
        for i in range(cfg.num_hidden_layers):
            state = LayerCache(SlidingWindowKV(cfg.sliding_window, cfg.head_dim, dtype, device))
            rate = cfg.compress_rate(i)
            if cfg.layer_types[i] != SLIDING:
                width = cfg.head_dim * (2 if cfg.layer_types[i] == CSA else 1)
                state.compressor = CompressorState(
                    rate, width, cfg.head_dim, max_tokens // rate, dtype, device, kv_dtype
                )
            if cfg.layer_types[i] == CSA:
                dim = cfg.index_head_dim
                state.indexer = CompressorState(rate, 2 * dim, dim, max_tokens // rate, dtype, device, kv_dtype)
            layers.append(state)
        return DeepseekV4Cache(layers, max_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DeepseekV4Cache | Sequence[DeepseekV4Cache],
        seq_lens: Sequence[int] | None = None,
    ) -> torch.Tensor:
        tokens = input_ids.shape[0]
        batch = ForwardBatch(cache, tokens, seq_lens, input_ids.device)
        for s in batch.slices:
            s.cache.check_room(s.length)
        if self.segmented_decode and all(s.length == 1 for s in batch.slices):
            hidden = self._decode_in_cache_order(input_ids, batch)
        else:
            x = self.embed(input_ids)
            positions = batch.positions
            rope = StepRope(positions, self.rotations(positions, x.dtype), self.rope_tables["compress"])
            streams = self.input_streams(x)
            for layer in self.layers:
                streams = layer(streams, input_ids, rope, batch)
            hidden = self.final_hidden(streams)
        batch.advance()
        return hidden

    def _decode_in_cache_order(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """:func:`decode_step` over the sequences in their caches' order (serials), rows back in the batch's order: a
        layer's graph is keyed by its caches in order, so the same caches in another order (a new sequence in a
        finished one's cache, scheduled after the others) replay the graphs captured for them."""
        order = sorted(range(len(batch.slices)), key=lambda b: batch.slices[b].cache.serial)
        if order == sorted(order):
            return decode_step(self, input_ids, batch)
        index = torch.tensor(order, device=input_ids.device)
        caches = [batch.slices[b].cache for b in order]
        ordered = ForwardBatch(caches, len(order), [1] * len(order), input_ids.device)
        hidden = decode_step(self, input_ids.index_select(0, index), ordered)
        return torch.empty_like(hidden).index_copy_(0, index, hidden)

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rotation]:
        """Every rope kind's rotation of the rows at ``positions``: once per forward, layers share them."""
        return {kind: table(positions, dtype) for kind, table in self.rope_tables.items()}

    def input_streams(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens ``[T, H]`` as the ``hc_mult`` residual streams ``[T, hc, H]``."""
        return x[:, None, :].expand(x.shape[0], self.config.hc_mult, -1).contiguous()

    def decode_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A decode step's first segment: ``input_ids`` and ``positions`` (passed through, so later segments share
        one buffer of each), the residual streams and the rotations' tensors (:func:`rotation_tensors`)."""
        x = self.embed(input_ids)
        return input_ids, positions, self.input_streams(x), *rotation_tensors(self.rotations(positions, x.dtype))

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[T, H]`` of the last layer's streams (the hyper-head's collapse, then the norm)."""
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
