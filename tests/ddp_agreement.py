"""Run by tests/test_training.py under torchrun (2 processes, gloo): one data-parallel step (DDP or FSDP2)
against the same step taken by one process on both ranks' batches. Usage: ddp_agreement.py OUT_DIR KIND [distill]
(distill: the loss distilled from a frozen parent, unwrapped on every rank: headmix.training.distill)"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from headmix.models import build_model, get_config
from headmix.training.distributed import Parallel

out_dir, kind = sys.argv[1], sys.argv[2]
distill = sys.argv[3:] == ["distill"]
dist.init_process_group("gloo")
rank = dist.get_rank()
config = get_config("tiny-moa", task="translation", vocab_size=200).replace(dropout=0.0)
torch.manual_seed(0)
model = build_model(config)
initial = copy.deepcopy(model)
reference = copy.deepcopy(model)
g = torch.Generator().manual_seed(1)
batches = [{k: torch.randint(5, 200, (3, 7), generator=g) for k in ("src", "tgt_in", "tgt_out")} for _ in range(2)]


def loss_of(module, batch):
    out = module(**batch)
    return distiller(out, batch)[0] if distill else out.total_loss


if distill:
    from headmix.training.distill import Distiller

    torch.manual_seed(5)
    distiller = Distiller(build_model(config), weight=0.4, temperature=2.0, input_names=("src", "tgt_in"),
                          pad_id=config.pad_id, device="cpu", dtype=torch.float32)
par = Parallel(model, kind, torch.device("cpu"), make_plain=lambda: build_model(config))
opt = torch.optim.SGD(par.module.parameters(), lr=0.5)
loss_of(par.module, batches[rank]).backward()
opt.step()
full = par.full_model()

ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
(sum(loss_of(reference, b) for b in batches) / 2).backward()
ref_opt.step()

if rank == 0:
    ours, ref, init = full.state_dict(), reference.state_dict(), initial.state_dict()
    diff = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    changed = sum(int(not torch.equal(ours[k], init[k])) for k in ref)
    Path(out_dir, f"{kind}{'_distill' if distill else ''}_result.json").write_text(json.dumps({"max_abs_diff": diff, "changed": changed}))
dist.destroy_process_group()
