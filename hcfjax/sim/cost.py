"""Step time of one instance from FLOPs and bytes per layer, against a GPU's datasheet and an efficiency profile.

Each part of a layer costs max(FLOPs / (peak x compute efficiency), bytes / (HBM x memory efficiency)); parts do not
overlap. A step sums its layers, the LM head, the MTP draft passes and fixed overheads:

    layer = max over DP ranks (attention projections + attention core + dense MLP or shared experts)
            + routed experts (the busiest GPU: the EPLB imbalance factor times the mean share)
            + EP all-to-all (dispatch + combine) + TP all-reduces + per-layer overhead

- MLA: decode is absorbed (kv_b folded into the query and the output: per query token, C x H x (N + V) MACs; the
  core reads each cached latent once per request, 2 H (2C + R) FLOPs per query-key pair). Prefill is not absorbed:
  kv_b expands every key position it attends to, and the core costs 2 H (N + R + V) FLOPs per pair.
- MoE: the routed experts' weights are read only for experts some token hits (uniform routing:
  E (1 - (1 - k/E)^T) of E for T tokens); their FLOPs scale with T x k. int4 weights are 0.5 byte + a bf16 scale per
  group of 128; a8 schemes run at the int8 rate, a16 at bf16.
- Quantisation follows hcfjax/quantize.py: w8a8 linears are MLA's down projections, q_b / o, dense and shared MLPs
  and the MTP combiner; kv_b, routers and LM heads stay bf16. fp8 prices the same linears and the experts as w8a8
  does, at 1 byte plus a float32 scale per 128 x 128 block; its MTP combiner stays bf16. q_b / o run at the int8
  rate where the scheme holds them in int8 or fp8 (at bf16's where a checkpoint holds them in bf16: float_heads);
  kv_b at bf16's.
- EP all-to-all: a token goes to each rank holding one of its k experts (probability 1 - (1 - 1/ep)^k per rank),
  NVLink inside a node, RDMA across; dispatch in 1 byte per value with a8 experts, combine in bf16; each call pays
  a fixed latency. TP all-reduce: a ring over NVLink, twice per layer.
- KV transfer: bytes of the request's cache over the receiving GPU's NIC, or over a link measured as a whole.
"""

from __future__ import annotations

import dataclasses

from hcfjax.config import QUANT_SCHEMES, ModelConfig
from hcfjax.sim.gpus import GPU, Efficiency
from hcfjax.sim.weights import WEIGHT_BYTES, LayerParams, bytes_per_gpu, kind_bytes, main_weights, mtp_weights


@dataclasses.dataclass
class Work:
    """One DP rank's share of a step (every count is summed over the rank's rows)."""

    tokens: int = 0  # tokens through the linears (decode rows x tokens per row + prefill tokens)
    pre_tokens: int = 0  # of which prefill tokens
    logits: int = 0  # rows through the LM head
    dec_pairs: int = 0  # decode query-key pairs (per row: query tokens x cached keys)
    dec_kv: int = 0  # cached positions the decode rows read (each row's keys once)
    pre_pairs: int = 0  # prefill query-key pairs
    pre_kv: int = 0  # cached positions the prefill rows read
    pre_expand: int = 0  # latent positions kv_b expands for prefill
    mtp_tokens: int = 0  # tokens through each of the k MTP draft passes
    mtp_pairs: int = 0
    mtp_kv: int = 0

    def __iadd__(self, other: Work) -> Work:
        for name in _WORK_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


_WORK_FIELDS = tuple(f.name for f in dataclasses.fields(Work))


@dataclasses.dataclass
class StepCost:
    seconds: float
    parts: dict[str, float]  # where the time went (the critical rank's parts)


def roof(flops: float, nbytes: float, peak: float, bw: float, ce: float, me: float) -> float:
    return max(flops / (peak * ce), nbytes / (bw * me))


class CostModel:
    """Step times of one instance: `tp` GPUs per DP rank, `dp` ranks, experts over `ep` of the tp x dp GPUs.

    quant: None (bf16) or a key of config.QUANT_SCHEMES; kv_int8 overrides the scheme's cache dtype;
    imbalance: the EPLB factor (busiest rank's expert load over the mean); spec_k: MTP draft passes per decode step;
    attn_int8: the attention core runs at the int8/fp8 tensor-core rate (an FP8 MLA kernel), else at bf16's;
    float_heads: MLA's q_b / o in bf16 whatever the scheme, in bytes and rate (weights.holds_float_heads).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        gpu: GPU,
        eff: Efficiency,
        quant: str | None = None,
        tp: int = 1,
        dp: int = 1,
        ep: int = 1,
        imbalance: float = 1.0,
        spec_k: int = 0,
        kv_int8: bool | None = None,
        attn_int8: bool = False,
        float_heads: bool = False,
    ):
        if quant is not None and quant not in QUANT_SCHEMES:
            raise ValueError(f"quant must be None or one of {sorted(QUANT_SCHEMES)}, got {quant!r}")
        self.gpus = tp * dp
        if ep < 1 or self.gpus % ep:
            raise ValueError(f"ep={ep} must divide the instance's {self.gpus} GPUs")
        self.cfg, self.gpu, self.eff, self.quant = cfg, gpu, eff, quant
        self.tp, self.dp, self.ep, self.imbalance, self.spec_k = tp, dp, ep, imbalance, spec_k
        self.attn_int8, self.float_heads = attn_int8, float_heads
        experts, linear, kv = QUANT_SCHEMES[quant] if quant else (None, None, None)
        self.kv_int8 = (kv == "int8") if kv_int8 is None else kv_int8
        c = cfg
        p = LayerParams.of(c)
        self.p_down, self.p_head, self.p_kvb = p.down, p.heads, p.kv_b  # q_a/kv_a and q_b + o (w8a8 under w4a8c8); kv_b
        self.p_dense, self.p_expert, self.p_shared = p.dense, p.expert, p.shared
        self.p_router, self.p_lm = p.router, p.lm
        self.w_lin, self.w_exp = WEIGHT_BYTES[linear], WEIGHT_BYTES[experts]
        # q_b / o and the MTP combiner (int schemes only) as the weights' table prices them
        self.w_head, self.w_comb = kind_bytes("heads", quant, float_heads), kind_bytes("combiner", quant)
        # fp8 runs at the int8 rate (the datasheets give both the same TOP/s)
        self.lin_int8, self.exp_int8 = linear in ("w8a8", "fp8"), experts in ("w4a8", "w8a8", "fp8")
        self.comb_int8 = self.lin_int8 and linear != "fp8"
        self.head_int8 = self.lin_int8 and not float_heads  # q_b / o held as the linears are
        # per token and layer: c_kv and k_pe, int8 with two float32 scales (hcfjax/cache.py) or bf16
        self.kv_bytes_token_layer = c.kv_dim * (1 if self.kv_int8 else 2) + (8 if self.kv_int8 else 0)
        self.n_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        self.n_dense = c.num_hidden_layers - self.n_moe
        self.mtp_moe = c.n_routed_experts > 0  # DeepSeek's MTP layers follow the MoE rule (index >= first_k_dense)

    # -- sizes -------------------------------------------------------------------------------------------------------
    def kv_bytes(self, tokens: int, layers: int | None = None) -> float:
        """Bytes of `tokens` cache positions over `layers` (default: the decoder layers plus one per draft depth)."""
        if layers is None:
            layers = self.cfg.num_hidden_layers + self.spec_k
        return tokens * layers * self.kv_bytes_token_layer

    def weight_bytes_per_gpu(self) -> float:
        """Weights one GPU holds, split as the sharding plans split them (weights.py); MTP modules counted when
        speculating."""
        weights = main_weights(self.cfg) + (mtp_weights(self.cfg) if self.spec_k else [])
        return bytes_per_gpu(weights, self.quant, self.tp, self.gpus, self.float_heads)

    # -- time ---------------------------------------------------------------------------------------------------------
    def step(self, works: list[Work]) -> StepCost:
        """Time of one step; works[r] is DP rank r's share (missing ranks idle)."""
        eff, g = self.eff, self.gpu
        hbm = g.hbm_bytes_s
        total_tokens = sum(w.tokens for w in works)
        if total_tokens == 0:
            return StepCost(0.0, {})
        ranks = [self._rank_layer(w) for w in works]
        dense_l = max(ranks, key=lambda r: r[0])
        moe_l = max(ranks, key=lambda r: r[1])
        parts: dict[str, float] = {}

        def add(name, t, n=1):
            parts[name] = parts.get(name, 0.0) + t * n

        for name, t in dense_l[2].items():
            add(name, t, self.n_dense)
        for name, t in moe_l[3].items():
            add(name, t, self.n_moe)
        routed = self._routed(total_tokens)
        a2a = self._all_to_all(max(w.tokens for w in works))
        add("moe_routed", routed, self.n_moe)
        add("ep_all_to_all", a2a, self.n_moe)
        if self.tp > 1:
            ar = self._all_reduce(max(w.tokens for w in works))
            add("tp_all_reduce", 2 * ar, self.cfg.num_hidden_layers)
        lm = max(
            roof(
                2 * w.logits * self.p_lm / self.tp,
                self.p_lm * 2 / self.tp,
                g.flops(False),
                hbm,
                eff.gemm_compute,
                eff.gemm_memory,
            )
            if w.logits
            else 0.0
            for w in works
        )
        add("lm_head", lm)
        mtp_tokens = sum(w.mtp_tokens for w in works)
        if self.spec_k and mtp_tokens:
            add("mtp_drafts", self.spec_k * self._mtp_pass(works, mtp_tokens))
        layers = self.cfg.num_hidden_layers + (self.spec_k if mtp_tokens else 0)
        add("overhead", eff.step_overhead_s + layers * eff.layer_overhead_s)
        return StepCost(sum(parts.values()), parts)

    def _rank_layer(self, w: Work) -> tuple[float, float, dict, dict]:
        """(dense-layer time, MoE-layer time without routed experts and all-to-all, their parts) for one rank."""
        eff, g, tp, c = self.eff, self.gpu, self.tp, self.cfg
        hbm, bf16 = g.hbm_bytes_s, g.flops(False)
        lin_peak = g.flops(self.lin_int8)
        t = w.tokens
        dec_tokens = t - w.pre_tokens
        gc, gm = eff.gemm_compute, eff.gemm_memory
        if t == 0:
            return 0.0, 0.0, {}, {}
        # q_b / o run at their format's rate, kv_b at bf16's: one roof over both, q_b / o's FLOPs scaled to bf16's
        # rate so that they take their own rate's time
        head_flops = 2 * t * self.p_head * bf16 / g.flops(self.head_int8)
        attn_lin = roof(2 * t * self.p_down / tp, self.p_down * self.w_lin / tp, lin_peak, hbm, gc, gm) + roof(
            (head_flops + 2 * (dec_tokens + w.pre_expand) * self.p_kvb) / tp,
            (self.p_head * self.w_head + self.p_kvb * 2) / tp,
            bf16,
            hbm,
            gc,
            gm,
        )
        h, cc, r = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        kvb = self.kv_bytes_token_layer
        ac, am = eff.attn_compute, eff.attn_memory
        core_dec = (
            roof(w.dec_pairs * 2 * h * (2 * cc + r) / tp, w.dec_kv * kvb, bf16, hbm, ac, am) if w.dec_pairs else 0
        )
        pre_flops = w.pre_pairs * 2 * h * (c.qk_nope_head_dim + r + c.v_head_dim) / tp
        core_pre = roof(pre_flops, w.pre_kv * kvb, bf16, hbm, ac, am) if w.pre_pairs else 0.0
        dense = roof(2 * t * self.p_dense / tp, self.p_dense * self.w_lin / tp, lin_peak, hbm, gc, gm)
        shared = roof(2 * t * self.p_shared / tp, self.p_shared * self.w_lin / tp, lin_peak, hbm, gc, gm) + roof(
            2 * t * self.p_router, self.p_router * 2, bf16, hbm, gc, gm
        )
        base = {"attn_proj": attn_lin, "attn_decode": core_dec, "attn_prefill": core_pre}
        return (
            attn_lin + core_dec + core_pre + dense,
            attn_lin + core_dec + core_pre + shared,
            {**base, "dense_mlp": dense},
            {**base, "moe_shared": shared},
        )

    def _routed(self, tokens: int) -> float:
        """The busiest GPU's routed-expert time for `tokens` tokens of the whole instance."""
        c, eff, g = self.cfg, self.eff, self.gpu
        if not c.n_routed_experts or not tokens:
            return 0.0
        k, e = c.num_experts_per_tok, c.n_routed_experts
        split = self.gpus // self.ep  # GPUs sharing each expert (tensor-parallel experts)
        hit = e / self.ep * (1 - (1 - k / e) ** tokens)
        imb = self.imbalance if self.ep > 1 else 1.0
        flops = 2 * tokens * k * self.p_expert / self.gpus * imb
        nbytes = min(e / self.ep, hit * imb) * self.p_expert * self.w_exp / split
        return roof(flops, nbytes, g.flops(self.exp_int8), g.hbm_bytes_s, eff.moe_compute, eff.moe_memory)

    def _all_to_all(self, rank_tokens: int) -> float:
        """Dispatch + combine time of one MoE layer; rank_tokens: the most tokens one DP rank holds."""
        if self.ep <= 1 or not rank_tokens:
            return 0.0
        c, g, eff = self.cfg, self.gpu, self.eff
        ep, k = self.ep, c.num_experts_per_tok
        send = rank_tokens / self.tp  # TP ranks split the tokens they hold between them before dispatch
        p = 1 - (1 - 1 / ep) ** k  # a given rank holds one of the token's experts
        node = min(ep, g.per_node)
        total = 0.0
        for value_bytes in (1 if self.exp_int8 else 2, 2):  # dispatch, combine
            intra = send * (node - 1) * p * c.hidden_size * value_bytes * self.imbalance
            inter = send * (ep - node) * p * c.hidden_size * value_bytes * self.imbalance
            t = max(intra / (g.nvlink_bytes_s * eff.nvlink), inter / (g.rdma_bytes_s * eff.rdma))
            total += eff.comm_latency_s + t
        return total

    def _all_reduce(self, tokens: int) -> float:
        nbytes = tokens * self.cfg.hidden_size * 2
        ring = 2 * (self.tp - 1) / self.tp * nbytes
        return self.eff.comm_latency_s + ring / (self.gpu.nvlink_bytes_s * self.eff.nvlink)

    def _mtp_pass(self, works: list[Work], tokens: int) -> float:
        """One MTP draft module over the rows: combiner, one decoder layer, the LM head."""
        g, eff = self.gpu, self.eff
        layer = []
        for w in works:
            sub = Work(tokens=w.mtp_tokens, dec_pairs=w.mtp_pairs, dec_kv=w.mtp_kv, logits=w.mtp_tokens)
            _, moe_t, _, _ = self._rank_layer(sub) if w.mtp_tokens else (0, 0, {}, {})
            p_comb = 2 * self.cfg.hidden_size**2
            comb = roof(
                2 * w.mtp_tokens * p_comb / self.tp,
                p_comb * self.w_comb / self.tp,
                g.flops(self.comb_int8),
                g.hbm_bytes_s,
                eff.gemm_compute,
                eff.gemm_memory,
            )
            lm = roof(
                2 * w.mtp_tokens * self.p_lm / self.tp,
                self.p_lm * 2 / self.tp,
                g.flops(False),
                g.hbm_bytes_s,
                eff.gemm_compute,
                eff.gemm_memory,
            )
            layer.append(moe_t + comb + lm)
        routed = self._routed(tokens) + self._all_to_all(max(w.mtp_tokens for w in works)) if self.mtp_moe else 0.0
        return max(layer) + routed

    # -- transfers -----------------------------------------------------------------------------------------------
    def transfer_seconds(self, nbytes: float) -> float:
        """KV bytes over one GPU's NIC (the receiving decode rank's), or over the measured link the profile names."""
        eff = self.eff
        if eff.transfer_gbs:
            return eff.transfer_latency_s + nbytes / (eff.transfer_gbs * 1e9)
        return eff.comm_latency_s + nbytes / (self.gpu.rdma_bytes_s * eff.rdma)


def tokens_per_step(acceptance: list[float]) -> float:
    """Expected tokens a speculative step emits: 1 + a1 + a1 a2 + ... (acceptance conditional per depth)."""
    total, p = 1.0, 1.0
    for a in acceptance:
        p *= a
        total += p
    return total
