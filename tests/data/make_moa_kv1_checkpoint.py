"""Writes moa_kv1_checkpoint.pt with the MoA layer of commit 781c003 (before kv_heads existed).

Run with that commit's sources first on the path:
``git archive 781c003 src | tar -x -C /tmp/old && PYTHONPATH=/tmp/old/src python tests/data/make_moa_kv1_checkpoint.py tests/data/moa_kv1_checkpoint.pt``
"""
import torch, sys, platform
torch.set_num_threads(1)  # as tests/conftest.py
from headmix import MixtureOfAttentionHeads
torch.manual_seed(0)
layer = MixtureOfAttentionHeads(16, num_experts=4, top_k=2, head_dim=8).eval()
with torch.no_grad():
    layer.router.gate.weight.normal_()
    layer.out_bias.normal_()
    layer.k_proj.bias.normal_()
x = torch.randn(2, 5, 16)
kpm = torch.zeros(2, 5, dtype=torch.bool); kpm[1, 3:] = True
out = layer(x, is_causal=True, key_padding_mask=kpm)
torch.save({"state_dict": layer.state_dict(), "x": x, "key_padding_mask": kpm, "output": out.output,
            "aux_loss": out.aux_loss, "torch": str(torch.__version__), "machine": platform.machine()}, sys.argv[1])
