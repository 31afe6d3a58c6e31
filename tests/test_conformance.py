"""headmix against the peers' own code, with copied weights: outputs, all gradients, masks, cache decoding.

- Hugging Face ``JetMoeAttention`` (transformers) vs MoA ``renormalize="live"``, ``kv_heads=G``, rotary,
  output bias only; its load-balancing loss vs ``load_balance_fractions="per_token"``.
- x-transformers ``Attention`` with talking heads and a separate value head size vs Talking-Heads attention;
  with rotary vs MHA with interleaved rotary.
- The MoH authors' ViT attention (SkyworkAI/MoH, ``MoH-ViT/attention.py``): its module needs timm-era
  inputs (relative position tables) and computes a cosine attention, so its forward's head weighting is
  re-implemented below as a small independent reference, around standard scaled dot-product heads.

docs/implementations.md lists what each test shows and what differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headmix import MixtureOfAttentionHeads, MixtureOfHeadsAttention, MultiHeadAttention, RotaryEmbedding, TalkingHeadsAttention

transformers = pytest.importorskip("transformers")


def _x_transformers():
    """x-transformers' attention module, or the calling test skipped (its JetMoe neighbours still run)."""
    return pytest.importorskip("x_transformers.x_transformers")


from transformers import DynamicCache, JetMoeConfig  # noqa: E402
from transformers.models.jetmoe.modeling_jetmoe import (  # noqa: E402
    JetMoeAttention,
    JetMoeRotaryEmbedding,
    load_balancing_loss_func,
)


def _assert_grads(pairs, atol=2e-5, rtol=1e-4):
    for name, ours, theirs in pairs:
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------- Hugging Face JetMoe

def _jetmoe_pair(kv_heads: int = 2, top_k: int = 2, experts: int = 4, head_dim: int = 8, hidden: int = 32):
    torch.manual_seed(0)
    config = JetMoeConfig(hidden_size=hidden, kv_channels=head_dim, num_key_value_heads=kv_heads,
                          num_local_experts=experts, num_experts_per_tok=top_k, num_hidden_layers=1,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                          attn_implementation="eager")
    theirs = JetMoeAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
    ours = MixtureOfAttentionHeads(hidden, experts, top_k, head_dim, kv_heads=kv_heads, renormalize="live",
                                   bias=False, out_bias=True, rotary=True, rotary_base=1000.0,
                                   load_balance_fractions="per_token").eval()
    with torch.no_grad():
        ours.query_experts.copy_(theirs.experts.input_linear.weight.transpose(1, 2))
        ours.output_experts.copy_(theirs.experts.output_linear.weight.transpose(1, 2))
        ours.out_bias.copy_(theirs.experts.bias)
        ours.router.gate.weight.copy_(theirs.experts.router.layer.weight)
        k_weight, v_weight = theirs.kv_proj.weight.chunk(2, dim=0)
        ours.k_proj.weight.copy_(k_weight)
        ours.v_proj.weight.copy_(v_weight)
    return config, theirs, ours


def _jetmoe_grads(theirs: JetMoeAttention, ours: MixtureOfAttentionHeads):
    k_grad, v_grad = theirs.kv_proj.weight.grad.chunk(2, dim=0)
    return [("query_experts", ours.query_experts.grad, theirs.experts.input_linear.weight.grad.transpose(1, 2)),
            ("output_experts", ours.output_experts.grad, theirs.experts.output_linear.weight.grad.transpose(1, 2)),
            ("out_bias", ours.out_bias.grad, theirs.experts.bias.grad),
            ("router", ours.router.gate.weight.grad, theirs.experts.router.layer.weight.grad),
            ("k_proj", ours.k_proj.weight.grad, k_grad), ("v_proj", ours.v_proj.weight.grad, v_grad)]


def _hf_mask(padding: torch.Tensor) -> torch.Tensor:
    """Causal + key padding as the additive (batch, 1, T, T) mask the HF attention functions take."""
    batch, time = padding.shape
    forbidden = torch.ones(time, time, dtype=torch.bool).triu(1)[None, None] | padding[:, None, None, :]
    return torch.zeros(batch, 1, time, time).masked_fill(forbidden, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_jetmoe_attention_outputs_gradients_and_load_balance(kv_heads):
    config, theirs, ours = _jetmoe_pair(kv_heads=kv_heads)
    batch, time = 2, 6
    x = torch.randn(batch, time, config.hidden_size)
    padding = torch.zeros(batch, time, dtype=torch.bool)
    padding[1, 4:] = True                                   # right padding in row 1
    positions = torch.arange(time)[None].expand(batch, -1)
    cos_sin = JetMoeRotaryEmbedding(config)(x, positions)

    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs, _, router_logits = theirs(x_theirs, attention_mask=_hf_mask(padding), position_embeddings=cos_sin)
    out = ours(x_ours, is_causal=True, key_padding_mask=padding)
    torch.testing.assert_close(out.output, out_theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.routing.logits, router_logits)

    w = torch.randn_like(out_theirs)
    (out_theirs * w).sum().backward()
    (out.output * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=2e-5, rtol=1e-4)
    _assert_grads(_jetmoe_grads(theirs, ours))

    # their load balance: fractions of tokens per expert (sum k) times mean probabilities, over real tokens
    lb_theirs = load_balancing_loss_func((router_logits,), config.num_local_experts, config.num_experts_per_tok,
                                         attention_mask=(~padding).long())
    torch.testing.assert_close(out.losses["load_balance"], lb_theirs)
    ours.load_balance_fractions = "normalized"
    torch.testing.assert_close(config.num_experts_per_tok * ours(x, is_causal=True, key_padding_mask=padding).losses["load_balance"],
                               lb_theirs)


def test_jetmoe_attention_cache_decoding():
    config, theirs, ours = _jetmoe_pair(kv_heads=2)
    batch, time, prompt = 2, 7, 3
    x = torch.randn(batch, time, config.hidden_size)
    rotary = JetMoeRotaryEmbedding(config)
    no_padding = torch.zeros(batch, time, dtype=torch.bool)
    with torch.no_grad():
        full_theirs, _, _ = theirs(x, attention_mask=_hf_mask(no_padding),
                                   position_embeddings=rotary(x, torch.arange(time)[None].expand(batch, -1)))
        cache_theirs = DynamicCache(config=config)
        step = x[:, :prompt]
        steps_theirs = [theirs(step, attention_mask=_hf_mask(no_padding[:, :prompt]), past_key_values=cache_theirs,
                               position_embeddings=rotary(step, torch.arange(prompt)[None].expand(batch, -1)))[0]]
        out = ours(step, is_causal=True, use_cache=True)
        steps_ours, cache = [out.output], out.cache
        for t in range(prompt, time):
            step = x[:, t:t + 1]
            steps_theirs.append(theirs(step, attention_mask=None, past_key_values=cache_theirs,
                                       position_embeddings=rotary(step, torch.full((batch, 1), t)))[0])
            out = ours(step, is_causal=True, use_cache=True, cache=cache)
            steps_ours.append(out.output)
            cache = out.cache
    torch.testing.assert_close(torch.cat(steps_theirs, 1), full_theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps_ours, 1), full_theirs, atol=1e-5, rtol=1e-4)
    # the same cached (rotated) keys and values, G heads of head_dim per token
    keys_theirs, values_theirs = cache_theirs.layers[0].keys, cache_theirs.layers[0].values
    torch.testing.assert_close(cache.key, keys_theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.value, values_theirs, atol=1e-5, rtol=1e-4)
    assert cache.key.shape == (batch, 2, time, config.kv_channels)


# --------------------------------------------------------------------------- x-transformers

def _copy_linear_no_bias(ours: MultiHeadAttention, theirs) -> None:
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.to_q.weight)
        ours.k_proj.weight.copy_(theirs.to_k.weight)
        ours.v_proj.weight.copy_(theirs.to_v.weight)
        ours.out_proj.weight.copy_(theirs.to_out.weight)


def _x_grads(ours: MultiHeadAttention, theirs):
    return [("q_proj", ours.q_proj.weight.grad, theirs.to_q.weight.grad),
            ("k_proj", ours.k_proj.weight.grad, theirs.to_k.weight.grad),
            ("v_proj", ours.v_proj.weight.grad, theirs.to_v.weight.grad),
            ("out_proj", ours.out_proj.weight.grad, theirs.to_out.weight.grad)]


@pytest.mark.parametrize("causal", [False, True])
def test_x_transformers_talking_heads_with_separate_value_size(causal):
    xt = _x_transformers()
    torch.manual_seed(1)
    dim, heads, key_dim, value_dim = 16, 4, 4, 6
    theirs = xt.Attention(dim, dim_head=key_dim, heads=heads, value_dim_head=value_dim, causal=causal,
                          pre_talking_heads=True, post_talking_heads=True).eval()
    with torch.no_grad():
        for conv in (theirs.attend.pre_softmax_talking_heads, theirs.attend.post_softmax_talking_heads):
            conv.weight.add_(0.3 * torch.randn_like(conv.weight))
    ours = TalkingHeadsAttention(dim, heads, head_dim=value_dim, key_dim=key_dim, bias=False,
                                 zero_padded_queries=True).eval()
    _copy_linear_no_bias(ours, theirs)
    with torch.no_grad():
        # x-transformers mixes the logits residually (sim + W sim) and the weights plainly (W attn)
        ours.pre_mix.copy_(torch.eye(heads) + theirs.attend.pre_softmax_talking_heads.weight[:, :, 0, 0])
        ours.post_mix.copy_(theirs.attend.post_softmax_talking_heads.weight[:, :, 0, 0])
    x = torch.randn(2, 5, dim)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 3:] = False
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs = theirs(x_theirs, mask=keep)
    out_ours = ours(x_ours, key_padding_mask=~keep, is_causal=causal).output
    torch.testing.assert_close(out_ours, out_theirs, atol=1e-5, rtol=1e-4)
    w = torch.randn_like(out_theirs)
    (out_theirs * w).sum().backward()
    (out_ours * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=2e-5, rtol=1e-4)
    pre_grad = theirs.attend.pre_softmax_talking_heads.weight.grad[:, :, 0, 0]
    post_grad = theirs.attend.post_softmax_talking_heads.weight.grad[:, :, 0, 0]
    _assert_grads(_x_grads(ours, theirs) + [("pre_mix", ours.pre_mix.grad, pre_grad),
                                            ("post_mix", ours.post_mix.grad, post_grad)])


def test_x_transformers_rotary_attention():
    """x-transformers 2.x rotates interleaved pairs (2i, 2i+1) of the first rot_dim dimensions."""
    xt = _x_transformers()
    torch.manual_seed(2)
    dim, heads, head_dim = 16, 2, 8
    theirs = xt.Attention(dim, dim_head=head_dim, heads=heads, causal=True).eval()
    rotary_theirs = xt.RotaryEmbedding(4, base=500)   # rotates half of each head
    ours = MultiHeadAttention(dim, heads, bias=False,
                              rotary=RotaryEmbedding(head_dim, base=500.0, fraction=0.5, interleaved=True)).eval()
    _copy_linear_no_bias(ours, theirs)
    x = torch.randn(2, 6, dim)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs = theirs(x_theirs, rotary_pos_emb=rotary_theirs(torch.arange(6)))
    out_ours = ours(x_ours, is_causal=True).output
    torch.testing.assert_close(out_ours, out_theirs, atol=1e-5, rtol=1e-4)
    w = torch.randn_like(out_theirs)
    (out_theirs * w).sum().backward()
    (out_ours * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=2e-5, rtol=1e-4)
    _assert_grads(_x_grads(ours, theirs))


# --------------------------------------------------------------------------- the MoH authors' code

class MoHReferenceCodeAttention(torch.nn.Module):
    """A re-implementation, for this test only, of the forward of ``Attention`` in SkyworkAI/MoH
    ``MoH-ViT/attention.py``: the head gates exactly as there (``wg``, ``wg_0``, ``wg_1``, the
    renormalisation clamped at ``eps``, ``l_aux``), with the attention map of each head replaced by plain
    ``softmax(q k^T / sqrt(d))`` (theirs is a cosine attention with relative position bias, which is not
    part of MoH). ``routed_head`` is the number of routed heads activated per token (top-k)."""

    def __init__(self, dim: int, num_heads: int, shared_head: int, routed_head: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.shared_head, self.routed_head = shared_head, routed_head
        self.qkv = torch.nn.Linear(dim, dim * 3)
        self.proj = torch.nn.Linear(dim, dim)
        self.wg = torch.nn.Linear(dim, num_heads - shared_head, bias=False)
        self.wg_0 = torch.nn.Linear(dim, 2, bias=False) if shared_head > 0 else None
        self.wg_1 = torch.nn.Linear(dim, shared_head, bias=False) if shared_head > 1 else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, N, C = x.shape
        _x = x.reshape(B * N, C)
        gates = F.softmax(self.wg(_x), dim=1)
        num_experts = gates.shape[1]
        _, indices = torch.topk(gates, k=self.routed_head, dim=1)
        mask = F.one_hot(indices, num_classes=num_experts).sum(dim=1)
        l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts
        routed = gates * mask
        denom = torch.clamp(routed.sum(dim=1, keepdim=True), min=torch.finfo(routed.dtype).eps)
        routed = (routed / denom).reshape(B, N, -1) * self.routed_head
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        heads = (torch.softmax(q @ k.transpose(-2, -1) * self.head_dim ** -0.5, dim=-1) @ v).transpose(1, 2)
        if self.shared_head > 1:
            shared = F.softmax(self.wg_1(_x), dim=1).reshape(B, N, -1) * self.shared_head
        else:
            shared = torch.ones(B, N, self.shared_head, dtype=x.dtype) * self.shared_head
        if self.shared_head == 0:
            g = routed
        else:
            weight_0 = F.softmax(self.wg_0(_x), dim=1).reshape(B, N, 2) * 2
            g = torch.cat([weight_0[:, :, :1] * shared, weight_0[:, :, 1:] * routed], dim=2)
        return self.proj((g[..., None] * heads).reshape(B, N, C)), l_aux


@pytest.mark.parametrize("shared,top_k", [(2, 3), (1, 2), (0, 2)])
def test_moh_matches_the_authors_head_weighting(shared, top_k):
    torch.manual_seed(3)
    dim, heads = 32, 8
    theirs = MoHReferenceCodeAttention(dim, heads, shared, top_k)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    ours = MixtureOfHeadsAttention(dim, heads, shared, top_k, load_balance_fractions="per_token").eval()
    assert ours.head_weighting == "renormalized"   # the default is the authors' form
    with torch.no_grad():
        q, k, v = theirs.qkv.weight.chunk(3, dim=0)
        qb, kb, vb = theirs.qkv.bias.chunk(3)
        for lin, weight, bias in ((ours.q_proj, q, qb), (ours.k_proj, k, kb), (ours.v_proj, v, vb),
                                  (ours.out_proj, theirs.proj.weight, theirs.proj.bias)):
            lin.weight.copy_(weight)
            lin.bias.copy_(bias)
        ours.routed_gate.weight.copy_(theirs.wg.weight)
        if shared:
            ours.group_gate.weight.copy_(theirs.wg_0.weight)
        if shared > 1:
            ours.shared_gate.weight.copy_(theirs.wg_1.weight)
    x = torch.randn(2, 5, dim)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs, l_aux = theirs(x_theirs)
    out = ours(x_ours)
    torch.testing.assert_close(out.output, out_theirs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.losses["load_balance"], l_aux)
    w = torch.randn_like(out_theirs)
    ((out_theirs * w).sum() + l_aux).backward()
    ((out.output * w).sum() + out.losses["load_balance"]).backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=2e-5, rtol=1e-4)
    qg, kg, vg = theirs.qkv.weight.grad.chunk(3, dim=0)
    pairs = [("q_proj", ours.q_proj.weight.grad, qg), ("k_proj", ours.k_proj.weight.grad, kg),
             ("v_proj", ours.v_proj.weight.grad, vg), ("out_proj", ours.out_proj.weight.grad, theirs.proj.weight.grad),
             ("routed_gate", ours.routed_gate.weight.grad, theirs.wg.weight.grad)]
    if shared:
        pairs.append(("group_gate", ours.group_gate.weight.grad, theirs.wg_0.weight.grad))
    if shared > 1:
        pairs.append(("shared_gate", ours.shared_gate.weight.grad, theirs.wg_1.weight.grad))
    _assert_grads(pairs)
    # today's other forms differ from the authors' code once top-k selects fewer than all routed heads
    ours.head_weighting = "scaled"
    assert not torch.allclose(ours(x).output, out_theirs, atol=1e-4)
