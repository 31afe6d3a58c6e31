"""Learned routers that get no gradient from the task loss, and the rule that refuses them.

A token-choice router learns from the task loss only through the weights it gives the experts (or heads) it
selects: the selection itself (top-k) has no gradient. Where those weights do not depend on the router's
scores, the router's parameters get no gradient from the task, and only an auxiliary loss (load balancing,
z-loss), if any, moves them. This happens, with any inputs, in exactly these cases (measured per option by
``tests/test_router_gradients.py``):

- MoH (also routed per K/V group) with ``head_weighting="renormalized"`` and ``top_k=1``: the selected routed head weighs
  ``a_r * k * p_i / sum_{j in TopK} p_j = a_r * p_i / p_i = a_r``: the routing probabilities cancel;
- MoH with one routed head (per group with ``route_per_group``), any ``head_weighting``: ``p =
  softmax`` over one head is the constant 1;
- MoA with ``top_k=1`` and ``renormalize="live"``: ``w_i = p_i / sum_{j in G} p_j = p_i / p_i = 1``;
- MoA with ``top_k=1`` and ``router="noisy_topk"``: ``w = softmax`` over the one kept logit, the constant 1
  (the noise weights ``W_noise`` get none either);
- MoA with ``num_experts=1``: ``p = softmax`` over one expert is the constant 1;
- GQE (the paper's, ``kind="gqe"``) without the weighted-sum slot (``weighted_slot=False``) and with unscaled
  hard slots (``hard_slot_scale="none"``): the router's probabilities reach the output only through the weighted
  slot (arXiv 2606.20945, eq. 6), so the hard slots alone give it none (the paper's Table 2 "hard concat only");
  with one expert per group ``p = softmax`` over one expert is the constant 1; with one selected head per token
  (``kv_heads=1``, ``top_k=1``) and unscaled hard slots the renormalised weighted slot's ``w = p / p`` is 1;
- the mixture-of-experts feed-forward (``ffn="moe_swiglu"``, weights ``softmax`` over the kept logits, i.e.
  ``renormalize="live"``) with ``ffn_top_k=1`` or ``ffn_experts=1``: the constant 1 (the model config's
  ``ffn_allow_router_without_task_gradient`` asks for it).

Everything else learns: MoA's default ``renormalize="detached"`` at ``top_k=1`` weighs ``p_i / Detach(p_i)``,
1 in value but with the gradient of ``p_i``; ``renormalize="none"`` weighs ``p_i``; MoH's ``"paper"`` and
``"scaled"`` weightings keep ``p_i``; SwitchHead's selectors and MoSA's router weigh by a sigmoid of their own
score. MoH's shared-head gate with one shared head is a softmax over one score (the constant 1, its ``W_s``
gets no gradient): harmless, since the shared head is always on and ``[a_s, a_r]`` (``W_h``) still learns.
The random-routing control (``router="random"``) has no router and is never refused.

The layers and :class:`~headmix.models.AttentionConfig` refuse such a router with a one-line ``ValueError``
naming the options and the alternatives, unless :data:`ALLOW_FLAG` is set (an ablation asked for by name).
"""

from __future__ import annotations

#: The option (layers and ``AttentionConfig``) that asks for a router without a task gradient, as an ablation.
ALLOW_FLAG = "allow_router_without_task_gradient"


def moa_router_without_task_gradient(num_experts: int, top_k: int, router: str,
                                     renormalize: str) -> tuple[str, str] | None:
    """``(why, alternatives)`` when MoA's learned router gets no task-loss gradient with these options, else None."""
    if router not in ("softmax", "noisy_topk"):  # the random control has no router to learn
        return None
    if num_experts == 1:
        return ("num_experts=1 (p = softmax over one expert is the constant 1)", "num_experts >= 2")
    if top_k == 1 and router == "noisy_topk":
        return ("router='noisy_topk' and top_k=1 (the weight is a softmax over the one kept logit, the constant 1)",
                "top_k >= 2, or router='softmax' with renormalize 'detached' (the paper's) or 'none'")
    if top_k == 1 and renormalize == "live":
        return ("renormalize='live' and top_k=1 (w_i = p_i / sum_TopK p = p_i / p_i = 1)",
                "top_k >= 2, or renormalize 'detached' (the paper's) or 'none'")
    return None


def ffn_router_without_task_gradient(experts: int, top_k: int) -> tuple[str, str] | None:
    """``(why, alternatives)`` when the mixture-of-SwiGLU-experts feed-forward's router (a softmax over the kept
    logits) gets no task-loss gradient, else None."""
    if experts == 1:
        return ("ffn_experts=1 (p = softmax over one expert is the constant 1)", "ffn_experts >= 2")
    if top_k == 1:
        return ("ffn_top_k=1 (the weight is a softmax over the one kept logit, the constant 1)", "ffn_top_k >= 2")
    return None


def moh_router_without_task_gradient(routed_per_group: int, top_k: int, head_weighting: str, router: str,
                                     route_per_group: bool = False) -> tuple[str, str] | None:
    """``(why, alternatives)`` when MoH's (GQE's) routed-head router gets no task-loss gradient, else None."""
    if router != "softmax" or routed_per_group == 0:  # no learned router: the random control, or every head shared
        return None
    where = " per group (route_per_group)" if route_per_group else ""
    if routed_per_group == 1:
        return (f"one routed head{where} (p = softmax over one head is the constant 1)",
                "more routed heads, or num_shared_heads + 1 (that head always on, no router)")
    if top_k == 1 and head_weighting == "renormalized":
        return (f"head_weighting='renormalized' and top_k=1{where} (the selected head weighs a_r * k * p_i / "
                f"sum_TopK p = a_r: the routing probabilities cancel)",
                "top_k >= 2, or head_weighting 'paper' or 'scaled' (they keep p_i)")
    return None


def gqe_router_without_task_gradient(experts_per_group: int, weighted_slot: bool, hard_slot_scale: str,
                                     router: str, slots: int = 2, renormalize: bool = True) -> tuple[str, str] | None:
    """``(why, alternatives)`` when GQE's per-group router gets no task-loss gradient, else None. ``slots``: the
    ``k G`` selected heads per token; ``renormalize``: the weighted slot's ``w = p / sum_selected p``."""
    if router != "softmax":  # the random control has no router to learn
        return None
    if experts_per_group == 1:
        return ("one expert per K/V group (p = softmax over one expert is the constant 1)",
                "num_experts >= 2 * kv_heads")
    if not weighted_slot and hard_slot_scale == "none":
        return ("weighted_slot=False and unscaled hard slots (the weighted slot is the router's only path to the "
                "output: the paper's 'hard concat only')", "weighted_slot=True (the paper's GQE), or "
                "hard_slot_scale='p'")
    if slots == 1 and renormalize and hard_slot_scale == "none":
        return ("one selected head per token (kv_heads=1, top_k=1: the weighted slot's w = p / p is the constant 1)",
                "top_k >= 2, kv_heads >= 2, hard_slot_scale='p' or weighted_slot_renormalize=False")
    return None


def check_router_learns(problem: tuple[str, str] | None, allowed: bool, layer: str, flag: str = ALLOW_FLAG) -> None:
    """One-line ``ValueError`` when ``problem`` (from the functions above) holds and the ablation was not asked for
    (``allowed``, the option ``flag``); ``layer`` names the layer or config field in the message."""
    if not isinstance(allowed, bool):
        raise ValueError(f"{flag} must be true or false, got {allowed!r}")
    if problem is not None and not allowed:
        why, alternatives = problem
        raise ValueError(f"{layer}: the learned router gets no gradient from the task loss with {why}; use "
                         f"{alternatives}, or set {flag}=True to train it anyway as an ablation")
