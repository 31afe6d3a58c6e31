"""Run by tests/test_training.py under torchrun (2 processes, gloo): one data-parallel step (DDP or FSDP2)
against the same step taken by one process on both ranks' batches. Usage: ddp_agreement.py OUT_DIR KIND [distill]
(distill: the loss distilled from a frozen parent, as the training loop sets it up: hashed by rank 0, loaded on every
rank, sharded under FSDP; its KL logged as the mean over the ranks: headmix.distillation)"""

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


extra = {}
if distill:  # as the training loop does it: hashed by rank 0 alone, loaded once per rank, sharded under FSDP
    import headmix.storage.files as files
    from headmix.distillation import Distiller, load_parent, shared_parent_identity
    from headmix.training.distributed import shard_by_layer
    from headmix.training.metrics import TrainingWindow

    folder = Path(out_dir, "parent")
    if rank == 0:
        torch.manual_seed(5)
        build_model(config).save_pretrained(folder)
    dist.barrier()
    hashed, real_sha = [], files.sha256_file
    files.sha256_file = lambda path: hashed.append(path) or real_sha(path)
    identity = shared_parent_identity(str(folder))
    files.sha256_file = real_sha
    distiller = Distiller(load_parent(str(folder), "cpu", torch.float32), weight=0.4, temperature=2.0,
                          input_names=("src", "tgt_in"), pad_id=config.pad_id, device="cpu", dtype=torch.float32,
                          shard=shard_by_layer if kind == "fsdp" else None)
    extra["parent_sharded"] = all(type(p).__name__ == "DTensor" for p in distiller.parent.parameters())
    records = [None, None]
    dist.all_gather_object(records, {"hashed": len(hashed), "identity": identity})
    extra["hashed_per_rank"] = [r["hashed"] for r in records]
    extra["same_identity"] = records[0]["identity"] == records[1]["identity"] and "model.safetensors" in identity["sha256"]
par = Parallel(model, kind, torch.device("cpu"), make_plain=lambda: build_model(config))
opt = torch.optim.SGD(par.module.parameters(), lr=0.5)
if distill:
    out = par.module(**batches[rank])
    loss, kl = distiller(out, batches[rank])
    loss.backward()
    window = TrainingWindow()
    window.add_batch(out, 1, kl)
    window.add_step(1.0, 1)
    extra["logged_kl"] = window.record(2)["distill_kl"]  # every rank records: the mean over ranks
else:
    loss_of(par.module, batches[rank]).backward()
opt.step()
full = par.full_model()

ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
(sum(loss_of(reference, b) for b in batches) / 2).backward()
ref_opt.step()
if distill:
    with torch.no_grad():
        extra["reference_kl"] = sum(float(distiller(initial(**b), b)[1]) for b in batches) / 2  # before the step

if rank == 0:
    ours, ref, init = full.state_dict(), reference.state_dict(), initial.state_dict()
    diff = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    changed = sum(int(not torch.equal(ours[k], init[k])) for k in ref)
    Path(out_dir, f"{kind}{'_distill' if distill else ''}_result.json").write_text(json.dumps({"max_abs_diff": diff, "changed": changed, **extra}))
dist.destroy_process_group()
