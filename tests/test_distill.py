"""Distillation from a parent (issue 52, ``headmix train --distill-from``): the loss exact against a float64
reference, the frozen parent, the loop's step by hand (gradient accumulation), alpha = 0 as plain training, the
parent's identity recorded and checked on resume, bf16, and the refusals."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from headmix.data import Tokenizer, load_embedded_documents, write_jsonl_documents
from headmix.models import build_model, get_config, load_pretrained
from headmix.runs import RunMismatchError
from headmix.storage.files import sha256_file
from headmix.training import TrainConfig, train
from headmix.training.distill import Distiller, distillation_kl, scored_positions
from headmix.training.metrics import read_metrics

VOCAB = 40


def reference_kl(student: torch.Tensor, parent: torch.Tensor, scored: torch.Tensor, t: float) -> torch.Tensor:
    """KL(softmax(parent / t) || softmax(student / t)) summed over the vocabulary, averaged over the scored
    positions, written out in float64 with no library softmax."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for s, p, keep in zip(student.reshape(-1, student.shape[-1]).double(), parent.reshape(-1, parent.shape[-1]).double(),
                          scored.reshape(-1).tolist()):
        if not keep:
            continue
        ps = torch.exp(p / t) / torch.exp(p / t).sum()
        qs = torch.exp(s / t) / torch.exp(s / t).sum()
        total = total + (ps * (torch.log(ps) - torch.log(qs))).sum()
        count += 1
    return total / max(count, 1)


def reference_ce(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The label-smoothed cross-entropy averaged over the scored positions, written out in float64."""
    logp = logits.double().log_softmax(-1).reshape(-1, logits.shape[-1])
    flat = targets.reshape(-1).clamp(min=0)
    nll = -logp.gather(1, flat[:, None])[:, 0]
    loss = (1 - smoothing) * nll - smoothing * logp.mean(-1)
    keep = scored.reshape(-1)
    return loss[keep].sum() / keep.sum()


def _models(task: str, seed: int = 0):
    config = get_config({"translation": "tiny-moa", "mlm": "tiny-moa", "lm": "llama-tiny-moh"}[task], task=task,
                        vocab_size=VOCAB)
    torch.manual_seed(seed)
    student = build_model(config.replace(dropout=0.0)).double()
    parent = build_model(config.replace(dropout=0.3)).double()  # its dropout must stay off
    return student, parent


def _inputs(task: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (3, 9), generator=g)
    targets = torch.randint(5, VOCAB, (3, 9), generator=g)
    targets[0, -3:] = 0  # padding
    targets[1, :2] = -100  # ignored
    if task == "translation":
        return {"src": ids, "tgt_in": torch.randint(5, VOCAB, (3, 9), generator=g), "tgt_out": targets}
    if task == "mlm":
        return {"input_ids": ids, "labels": targets}
    return {"input_ids": ids, "targets": targets}


@pytest.mark.parametrize("task", ["lm", "mlm", "translation"])
def test_the_loss_is_exact_against_a_float64_reference(task):
    """(1 - w) task loss + w T^2 KL + aux, KL summed over the vocabulary and averaged over the positions the task
    loss scores (padding and -100 left out), for every task, in float64."""
    from headmix.tasks import get_task

    student, parent = _models(task)
    inputs = _inputs(task)
    names = get_task(task).input_names
    w, t = 0.3, 2.5
    distiller = Distiller(parent, weight=w, temperature=t, input_names=names, pad_id=0, device="cpu",
                          dtype=torch.float64)
    out = student(**inputs)
    loss, kl = distiller(out, inputs)
    targets = next(v for k, v in inputs.items() if k not in names)
    scored = (targets != 0) & (targets != -100)
    with torch.no_grad():
        parent_logits = parent.eval()(**{k: inputs[k] for k in names}).logits
    ref_kl = reference_kl(out.logits.detach(), parent_logits, scored, t)
    ce = reference_ce(out.logits.detach(), targets, scored, student.config.label_smoothing)
    torch.testing.assert_close(out.lm_loss.double(), ce, rtol=1e-6, atol=0)  # the task loss: float32 inside
    expected = (1 - w) * out.lm_loss.double() + w * t * t * ref_kl + out.aux_loss.detach()
    assert loss.dtype == torch.float64 and ref_kl > 1e-3
    torch.testing.assert_close(kl, ref_kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-14)


def plain_kl(student: torch.Tensor, parent: torch.Tensor, scored: torch.Tensor, t: float) -> torch.Tensor:
    """The KL in one piece, as the formula reads (library log-softmax, every position at once): the unchunked
    reference of the chunked one, differentiable."""
    log_q, log_p = F.log_softmax(student / t, -1), F.log_softmax(parent / t, -1)
    keep = scored.to(student.dtype)
    return ((log_p.exp() * (log_p - log_q)).sum(-1) * keep).sum() / keep.sum().clamp(min=1)


@pytest.mark.parametrize("chunk", [1, 4, 7, 33, None])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("into_task_gradient", [False, True])
def test_the_chunked_kl_equals_the_unchunked_one_in_float64_gradients_included(chunk, temperature, into_task_gradient):
    """Chunked (odd chunk sizes, one larger than the 33 positions) and unchunked KL, and the explicit formula, agree
    within 1e-6 in float64; the student's gradient too, alone or added into a task loss's (into_task_gradient),
    scaled by the loss above it; the ignored positions get no KL gradient."""
    g = torch.Generator().manual_seed(4)
    student0 = torch.randn(3, 11, 37, dtype=torch.float64, generator=g) * 3
    parent = torch.randn(3, 11, 37, dtype=torch.float64, generator=g) * 3
    scored = torch.rand(3, 11, generator=g) > 0.3
    scored[0, :4] = False
    targets = torch.randint(0, 37, (33,), generator=g)

    def gradient(kl_fn):
        student = student0.clone().requires_grad_()
        kl = kl_fn(student)
        task = F.cross_entropy(student.reshape(-1, 37), targets)
        (0.7 * kl + (task if into_task_gradient else 0)).backward()
        return kl.detach(), student.grad

    kl, grad = gradient(lambda s: distillation_kl(s, parent, scored, temperature, chunk=chunk,
                                                  into_task_gradient=into_task_gradient))
    ref_kl, ref_grad = gradient(lambda s: plain_kl(s, parent, scored, temperature))
    assert ref_kl > 1e-2
    torch.testing.assert_close(kl, ref_kl, rtol=0, atol=1e-6)
    torch.testing.assert_close(kl, reference_kl(student0, parent, scored, temperature), rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    assert grad.abs().max() > 1e-3
    with torch.no_grad():  # no graph: the forward alone
        torch.testing.assert_close(distillation_kl(student0, parent, scored, temperature, chunk=chunk), ref_kl,
                                   rtol=0, atol=1e-6)
    if not into_task_gradient:  # the KL's own gradient is zero where a position is ignored
        assert torch.equal(grad[~scored], torch.zeros_like(grad[~scored]))


def test_a_parents_logits_made_a_chunk_at_a_time_from_its_hidden_states_give_the_same_kl_and_gradient():
    from headmix.distillation.kl import ParentLogits

    g = torch.Generator().manual_seed(5)
    hidden, head = torch.randn(2, 9, 6, dtype=torch.float64, generator=g), torch.randn(37, 6, dtype=torch.float64,
                                                                                        generator=g)
    features = torch.randn(2, 9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    own = torch.randn(37, 6, dtype=torch.float64, generator=g)
    scored = torch.ones(2, 9, dtype=torch.bool)
    kl = distillation_kl(features @ own.T, ParentLogits(hidden, lambda h: h @ head.T, 37), scored, 1.5, chunk=4)
    kl.backward()
    grad, features.grad = features.grad, None
    ref = plain_kl(features @ own.T, hidden @ head.T, scored, 1.5)
    ref.backward()
    torch.testing.assert_close(kl.detach(), ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, features.grad, rtol=0, atol=1e-6)


class _Allocations(TorchDispatchMode):
    """The element counts of the storages the operators inside allocate (views and in-place results left out)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for tensor in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in given \
                    and tensor.untyped_storage().nbytes():  # a new storage, not a view or an in-place result
                self.sizes.append((str(func), tensor.untyped_storage().nbytes() // tensor.element_size()))
        return out


def test_the_kl_allocates_nothing_larger_than_one_chunk_forward_or_backward():
    """Beside a task loss on the same logits (the loop's case), the KL's forward and backward produce no tensor
    larger than one chunk of positions x vocabulary: no logits-sized temporary, no second gradient (its gradient
    goes into the task loss's). Without into_task_gradient: its own gradient, and autograd's sum of the two."""
    positions, vocab, chunk = 60, 50, 7
    g = torch.Generator().manual_seed(6)
    features = torch.randn(positions, 8, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=g)
    parent = torch.randn(positions, vocab, generator=g)
    targets = torch.randint(0, vocab, (positions,), generator=g)
    for into, expected in ((True, []), (False, ["aten.zeros_like.default", "aten.add.Tensor"])):
        logits = features @ weight.T
        task = F.cross_entropy(logits, targets)
        with _Allocations() as seen:
            kl = distillation_kl(logits, parent, torch.ones(positions, dtype=torch.bool), 2.0, chunk=chunk,
                                 into_task_gradient=into)
        with _Allocations() as seen_backward:
            torch.autograd.backward([task, kl])  # the KL's node runs first, then the task loss's, then the hook
        large = [name for name, size in seen.sizes + seen_backward.sizes
                 if size > chunk * vocab and "log_softmax" not in name and "nll_loss" not in name and "mm" not in name]
        assert large == expected, (into, large)
        assert any(size == chunk * vocab for _, size in seen.sizes)  # it did work in chunks


def test_a_distilled_step_allocates_no_more_logits_sized_tensors_than_a_plain_one():
    """The training loop's step (Distiller): forward, loss, backward allocate the same tensors of the logits' size
    as the plain step's; the parent's logits are made a chunk at a time from its hidden states, the KL's gradient
    goes into the task loss's."""
    student, parent = _models("lm")
    inputs = _inputs("lm")
    distiller = Distiller(parent, weight=0.5, temperature=2.0, input_names=("input_ids",), pad_id=0, device="cpu",
                          dtype=torch.float64, chunk=5)
    size = 3 * 9 * VOCAB

    def logits_sized(loss_of) -> list[str]:
        with _Allocations() as seen:
            out = student(**inputs)
            loss_of(out).backward()
        return sorted(name for name, n in seen.sizes if n == size)

    plain = logits_sized(lambda out: out.total_loss)
    assert plain and logits_sized(lambda out: distiller(out, inputs)[0]) == plain


class _OneNode(torch.autograd.Function):
    """The logits and their cross-entropy out of one autograd node, as a compiled model returns them."""

    @staticmethod
    def forward(ctx, logits, targets):
        ctx.save_for_backward(logits, targets)
        return logits.clone(), F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @staticmethod
    def backward(ctx, grad_logits, grad_loss):
        logits, targets = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            grad, = torch.autograd.grad(F.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1)), x)
        return grad * grad_loss + grad_logits, None


def test_a_model_whose_logits_and_loss_leave_one_autograd_node_is_distilled_with_the_kls_own_gradient():
    """A compiled model returns its logits and its loss from one node, inside which their gradients meet: the KL
    cannot add into the task loss's there, and gives its own gradient (the step's gradient is the formula's)."""
    _, parent = _models("lm")
    inputs = _inputs("lm")
    targets = inputs["targets"].clamp(min=0)
    distiller = Distiller(parent, weight=0.4, temperature=2.0, input_names=("input_ids",), pad_id=0, device="cpu",
                          dtype=torch.float64, chunk=4)
    logits0 = torch.randn(3, 9, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(8),
                          requires_grad=True)
    logits, lm_loss = _OneNode.apply(logits0, targets)
    loss, _ = distiller(SimpleNamespace(logits=logits, lm_loss=lm_loss, aux_loss=torch.zeros(())),
                        {"input_ids": inputs["input_ids"], "targets": inputs["targets"]})
    loss.backward()
    x = logits0.detach().requires_grad_()
    with torch.no_grad():
        parent_logits = parent.eval()(inputs["input_ids"]).logits
    scored = scored_positions(inputs["targets"], 0)
    (0.6 * F.cross_entropy(x.reshape(-1, VOCAB), targets.reshape(-1)) + 0.4 * 4 * plain_kl(x, parent_logits, scored,
                                                                                          2.0)).backward()
    torch.testing.assert_close(logits0.grad, x.grad, rtol=0, atol=1e-6)


def test_into_task_gradient_without_a_task_loss_is_a_one_line_error_not_a_missing_gradient():
    student = torch.randn(4, 7, requires_grad=True)
    kl = distillation_kl(student * 1, torch.randn(4, 7), torch.ones(4, dtype=torch.bool), 1.0, into_task_gradient=True)
    with pytest.raises(RuntimeError, match=r"adds its gradient into the one the task loss gives the logits, and none "
                                           r"reached them"):
        kl.backward()


def test_the_training_record_reads_the_kl_once_not_per_micro_batch():
    """A micro-batch's KL is summed where it lies (here on the meta device, whose values cannot be read: any read
    per micro-batch fails); the record reads the sum once."""
    from headmix.training.metrics import TrainingWindow

    out = SimpleNamespace(aux_loss=torch.zeros(()), routing=[])
    window = TrainingWindow()
    for _ in range(3):
        window.add_batch(out, 3, torch.ones((), device="meta"))
    assert window.distill_kl.device.type == "meta"
    window = TrainingWindow()
    for kl in (0.3, 0.6):
        window.add_batch(out, 2, torch.tensor(kl))
    window.add_step(1.0, 10)
    assert window.record(1)["distill_kl"] == pytest.approx(0.45)


def test_the_kl_of_logits_without_a_scored_position_is_zero_and_its_gradient_is_the_students_only():
    student = torch.randn(2, 3, 7, requires_grad=True)
    parent = torch.randn(2, 3, 7, requires_grad=True)
    assert float(distillation_kl(student, parent, torch.zeros(2, 3, dtype=torch.bool), 1.0).detach()) == 0.0
    distillation_kl(student, parent, torch.ones(2, 3, dtype=torch.bool), 2.0).backward()
    assert student.grad is not None and parent.grad is None
    # equal logits: no divergence, at any temperature
    same = torch.randn(4, 7)
    assert float(distillation_kl(same, same.clone(), torch.ones(4, dtype=torch.bool), 3.0)) == pytest.approx(0, abs=1e-7)


def test_the_parent_gets_no_gradient_and_its_weights_stay_bit_identical():
    student, parent = _models("lm")
    before = {k: v.clone() for k, v in parent.state_dict().items()}
    distiller = Distiller(parent.train(), weight=0.7, temperature=2.0, input_names=("input_ids",), pad_id=0,
                          device="cpu", dtype=torch.float64)
    assert not parent.training and not any(p.requires_grad for p in parent.parameters())
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    inputs = _inputs("lm")
    first = distiller.parent_logits(inputs).full()
    for _ in range(3):
        optimizer.zero_grad()
        loss, _ = distiller(student(**inputs), inputs)
        loss.backward()
        optimizer.step()
    assert all(p.grad is None for p in parent.parameters())
    for k, v in parent.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(distiller.parent_logits(inputs).full(), first)  # eval mode: its dropout (0.3) is off


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("distill")
    write_jsonl_documents(load_embedded_documents(sources="kjv-bible")[:60], folder / "docs.jsonl")
    return folder


RUN = dict(task="lm", max_tokens=256, max_len=32, warmup_steps=1, log_every=1, eval_every=100, save_every=100,
           average_last=1, valid_size=0.1, test_size=0.1, progress=False, lr=3e-3)


@pytest.fixture(scope="module")
def parent(corpus) -> Path:
    """A tiny finished causal LM run (grouped-query attention), the parent of the runs here."""
    folder = corpus / "parent"
    train(TrainConfig(preset="llama3-tiny-gqa", out=str(folder), data=[str(corpus / "docs.jsonl")], vocab_size=300,
                      max_steps=3, **RUN))
    return folder


def _student(corpus: Path, parent: Path, name: str, **kw) -> TrainConfig:
    options = dict(init_from=str(parent), data=[str(corpus / "docs.jsonl")], out=str(corpus / name), max_steps=2,
                   dropout=0.0, **RUN)
    options.update(kw)
    return TrainConfig(**options)


def _hand_kl(student: torch.Tensor, parent: torch.Tensor, targets: torch.Tensor, t: float) -> torch.Tensor:
    keep = (targets != 0).reshape(-1)
    s = (student.reshape(-1, student.shape[-1])[keep] / t).log_softmax(-1)
    p = (parent.reshape(-1, parent.shape[-1])[keep] / t).log_softmax(-1)
    return (p.exp() * (p - s)).sum() / keep.sum()


def test_the_parent_is_loaded_once_on_its_device_in_the_training_dtype_and_frozen(parent):
    from headmix.training.distill import load_parent

    model = load_parent(str(parent), "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_one_distilled_step_with_gradient_accumulation_equals_the_step_by_hand(corpus, parent):
    """Step 1 of a distilled run with grad_accum 2: each micro-batch's (1 - w) CE + w T^2 KL + aux, divided by 2,
    from the parent's logits; AdamW at the first step's learning rate. The parent's file is unchanged."""
    parent_sha = sha256_file(parent / "model.safetensors")
    cfg = _student(corpus, parent, "accum", max_steps=1, save_every=1, grad_accum=2, distill_from=str(parent),
                   distill_weight=0.25, distill_temperature=2.0, warmup_steps=4)
    train(cfg)
    task = cfg.task_spec
    run = Path(cfg.out)
    tok = Tokenizer.load(run / "tokenizer")
    start = json.loads((run / "train_config.json").read_text())["sequence_start"]  # the run's convention
    dataset = task.dataset(task.read_items(run / "data" / "train.jsonl"), tok, cfg.max_len, sequence_start=start)
    batches = iter(task.loader(dataset, tok, max_tokens=cfg.max_tokens, train=True, seed=cfg.seed))
    torch.manual_seed(cfg.seed)
    model = load_pretrained(parent)
    teacher = load_pretrained(parent).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr * 0.25, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0)
    kls = []
    for _ in range(2):
        batch = task.model_inputs(next(batches), "cpu")
        out = model(**batch)
        with torch.no_grad():
            teacher_logits = teacher(batch["input_ids"]).logits
        kl = _hand_kl(out.logits, teacher_logits, batch["targets"], 2.0)
        ce = F.cross_entropy(out.logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=0)
        ((0.75 * ce + 0.25 * 4.0 * kl + out.aux_loss) / 2).backward()
        kls.append(float(kl.detach()))
    optimizer.step()
    looped = load_file(str(run / "checkpoints" / "step_00000001" / "model.safetensors"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(looped[k], v.detach(), rtol=1e-5, atol=1e-7, msg=k)
    record = [r for r in read_metrics(run) if r["split"] == "train"][0]
    assert record["distill_kl"] == pytest.approx(sum(kls) / 2, rel=1e-5)
    assert sha256_file(parent / "model.safetensors") == parent_sha


def test_weight_zero_is_plain_training_bit_for_bit(corpus, parent):
    plain = train(_student(corpus, parent, "plain", init_options='{"attention": "moh", "num_shared_heads": 2, '
                                                                  '"top_k": 2}'))
    zero = train(_student(corpus, parent, "zero", distill_from=str(parent), distill_weight=0.0,
                          init_options='{"attention": "moh", "num_shared_heads": 2, "top_k": 2}'))
    a, b = load_file(str(corpus / "plain" / "model.safetensors")), load_file(str(corpus / "zero" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain["valid"] == zero["valid"] and "distill_from" not in plain


def test_the_parent_is_recorded_and_a_changed_parent_is_refused_on_resume(corpus, parent, tmp_path):
    mine = tmp_path / "parent"
    shutil.copytree(parent, mine)
    cfg = _student(corpus, mine, "resume", distill_from=str(mine), max_steps=3, save_every=1)
    calls = iter(range(100))
    assert train(cfg, stop=lambda: "signal 15" if next(calls) == 2 else None)["stopped_by"] == "signal 15"
    run = Path(cfg.out)
    stored = json.loads((run / "train_config.json").read_text())["distill_parent"]
    assert stored == {"path": str(mine.resolve()), "kind": "headmix run",
                      "sha256": {"model.safetensors": sha256_file(mine / "model.safetensors")}}
    # the parent's weights change: the resume is refused in one line, and nothing is written
    weights = load_file(str(mine / "model.safetensors"))
    original = (mine / "model.safetensors").read_bytes()
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(mine / "model.safetensors"), metadata={"format": "pt", "headmix_tied": "{}"})
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(RunMismatchError, match=r"was distilled from .* whose model.safetensors had sha256 "
                                               r"[0-9a-f]{12}; it now has sha256 [0-9a-f]{12}: a run's parent cannot "
                                               r"change") as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} == before
    # the same parent again: the run finishes, and its summary names the parent
    (mine / "model.safetensors").write_bytes(original)
    summary = train(cfg)
    assert summary["steps"] == 3
    assert summary["distill_from"] == {**stored, "weight": 0.5, "temperature": 1.0}
    # another weight is another run
    with pytest.raises(RunMismatchError, match="distill_weight"):
        train(_student(corpus, mine, "resume", distill_from=str(mine), max_steps=3, distill_weight=0.9))


def test_a_distilled_run_under_bf16_autocast(corpus, parent):
    summary = train(_student(corpus, parent, "bf16", distill_from=str(parent), distill_temperature=2.0, bf16="on"))
    records = [r for r in read_metrics(corpus / "bf16") if r["split"] == "train"]
    assert summary["steps"] == 2 and all(math.isfinite(r["distill_kl"]) and r["distill_kl"] >= 0 for r in records)
    student, teacher = _models("lm")
    distiller = Distiller(teacher.float(), weight=0.5, temperature=2.0, input_names=("input_ids",), pad_id=0,
                          device="cpu", dtype=torch.float32,
                          autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    inputs = _inputs("lm")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = student.float()(**inputs)
    assert distiller.parent_logits(inputs).full().dtype == torch.bfloat16  # the parent runs under the same autocast
    loss, kl = distiller(out, inputs)
    assert kl.dtype == torch.float32 and math.isfinite(float(loss.detach()))


# ---------------------------------------------------------------------------------------- refusals
def _refused(corpus: Path, parent: Path, tmp_path: Path, argv: list[str], capsys, task: str = "lm") -> str:
    from headmix.cli.main import main

    out = tmp_path / "refused"
    code = main(["train", task, "--data", str(corpus / "docs.jsonl"), "--out", str(out), "--no-progress",
                 "--max-steps", "1", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists(), err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["--distill-weight", "1.5"], "--distill-weight must be a number in [0, 1], got 1.5"),
    (["--distill-weight", "-0.1"], "--distill-weight must be a number in [0, 1], got -0.1"),
    (["--distill-temperature", "0"], "--distill-temperature must be a number > 0, got 0.0"),
    (["--distill-temperature", "-2"], "--distill-temperature must be a number > 0, got -2.0"),
])
def test_bad_weight_or_temperature_is_refused_in_one_line(corpus, parent, tmp_path, capsys, argv, message):
    err = _refused(corpus, parent, tmp_path, ["--init-from", str(parent), "--distill-from", str(parent), *argv], capsys)
    assert message in err


def test_refusals_name_the_option_before_anything_is_written(corpus, parent, tmp_path, capsys):
    err = _refused(corpus, parent, tmp_path, ["--init-from", str(parent), "--distill-from", str(tmp_path / "nowhere")],
                   capsys)
    assert f"--distill-from {tmp_path / 'nowhere'} not found" in err
    (tmp_path / "empty").mkdir()
    err = _refused(corpus, parent, tmp_path, ["--init-from", str(parent), "--distill-from", str(tmp_path / "empty")],
                   capsys)
    assert f"--distill-from {tmp_path / 'empty'} holds no model (no config.json)" in err
    err = _refused(corpus, parent, tmp_path, ["--init-from", str(parent), "--distill-weight", "0.5"], capsys)
    assert "--distill-weight applies to a distill_from" in err
    # a run that would train its own tokenizer
    err = _refused(corpus, parent, tmp_path, ["--preset", "llama3-tiny-gqa", "--vocab-size", "300",
                                              "--distill-from", str(parent)], capsys)
    assert "the run would train a new tokenizer" in err
    # another tokenizer: another vocabulary
    other = corpus / "other"
    if not other.exists():
        train(TrainConfig(preset="llama3-tiny-gqa", out=str(other), data=[str(corpus / "docs.jsonl")],
                          vocab_size=280, max_steps=1, **RUN))
        capsys.readouterr()
    err = _refused(corpus, parent, tmp_path, ["--init-from", str(other), "--distill-from", str(parent)], capsys)
    assert f"--distill-from {parent}: its tokenizer (300 tokens" in err and "is not the run's (280 tokens" in err
    # a parent of another task
    err = _refused(corpus, parent, tmp_path, ["--preset", "tiny-moa", "--tokenizer", str(parent / "tokenizer"),
                                              "--distill-from", str(parent)], capsys, task="translation")
    assert f"--distill-from {parent} holds a 'lm' model; this run's task is 'translation'" in err


def test_a_folder_holding_a_runs_tokenizer_and_a_top_level_one_gives_the_runs_everywhere(corpus, parent, tmp_path):
    """One look-up of a model folder's tokenizer (:func:`headmix.runs.tokenizer.tokenizer_of`): a folder holding
    both a run's ``tokenizer/`` and a ``tokenizer.json`` beside its ``config.json`` gives ``tokenizer/`` to
    ``--init-from`` and to ``--distill-from`` alike (the two look-ups once had opposite precedence)."""
    from headmix.distillation.parent import parent_tokenizer_file, run_tokenizer_file
    from headmix.runs.tokenizer import tokenizer_of

    both = tmp_path / "both"
    shutil.copytree(parent, both, ignore=shutil.ignore_patterns("checkpoints"))
    vocab = json.loads((parent / "tokenizer" / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {token: i for i, token in enumerate(list(vocab["model"]["vocab"])[::-1])}
    (both / "tokenizer.json").write_text(json.dumps(vocab))  # the same tokens under other ids
    assert tokenizer_of(both) == str(both / "tokenizer")
    student = _student(corpus, both, "both", distill_from=str(both))
    assert student.tokenizer == str(both / "tokenizer")  # --init-from's
    assert run_tokenizer_file(student) == parent_tokenizer_file(both) == both / "tokenizer" / "tokenizer.json"
    student.validate()  # --distill-from's: the parent's tokenizer is the run's
    _student(corpus, parent, "from-parent", distill_from=str(both)).validate()


# ------------------------------------------------------------------------------------------- studies
def _study(corpus: Path, **kw):
    from headmix.study.spec import ParentSpec, RowSpec, StudySpec

    training = {k: v for k, v in RUN.items() if k not in ("task", "progress")}
    values = dict(name="tiny-distill", task="lm", baseline="llama3-tiny-gqa", data=[str(corpus / "docs.jsonl")],
                  seeds=[1], max_steps=2, matching="none", training={**training, "vocab_size": 300},
                  parent=ParentSpec(max_steps=2, seed=7), timing_rounds=6, timing_steps=1, timing_warmup=0,
                  rows=[RowSpec("dense"), RowSpec("dense distilled", distill={"temperature": 2.0}),
                        RowSpec("learned", init_options={"attention": "moh", "num_shared_heads": 2, "top_k": 2}),
                        RowSpec("pruned", init_options={"attention": "mha", "keep_heads": 2, "calibration_batches": 1},
                                control_of=["learned", "dense distilled"])])
    values.update(kw)
    spec = StudySpec(**values)
    spec.validate()
    return spec


@pytest.mark.parametrize("rows,message", [
    (lambda R: [R("dense", distill={})], "sets neither attention, solve, init_options nor distill"),
    (lambda R: [R("dense"), R("d", distill={"alpha": 1})], r"rows\['d'\].distill must be a table of weight and "
                                                          r"temperature"),
    (lambda R: [R("dense"), R("d", distill={"weight": 2})], r"rows\['d'\].distill.weight must be a number in \[0, 1\]"),
    (lambda R: [R("dense"), R("d", distill={"temperature": 0})], r"rows\['d'\].distill.temperature must be a number > 0"),
    (lambda R: [R("dense"), R("d", control_of=["dense", "nope"])], r"rows\['d'\].control_of must name a row of the "
                                                                   r"study, got 'nope'"),
    (lambda R: [R("dense"), R("d", control_of=["d"])], r"rows\['d'\].control_of must name another row"),
])
def test_a_distilled_row_or_a_control_list_the_study_cannot_take_is_refused(corpus, rows, message):
    from headmix.study.spec import RowSpec

    with pytest.raises(ValueError, match=message):
        _study(corpus, rows=rows(RowSpec))


def test_distillation_needs_the_studys_parent(corpus):
    from headmix.study.spec import RowSpec, StudySpec

    with pytest.raises(ValueError, match=r"rows \['d'\] set distill, which distils from the study's parent"):
        StudySpec(name="s", task="lm", baseline="llama3-tiny-gqa", rows=[RowSpec("GQA"), RowSpec("d", distill={})],
                  matching="none").validate()
    with pytest.raises(ValueError, match=r"training must not set \['distill_weight'\]"):
        _study(corpus, training={"distill_weight": 0.5})


def test_a_distilled_row_continues_from_the_parent_and_its_timing_counts_the_parents_forward(corpus, tmp_path,
                                                                                           monkeypatch):
    from headmix.study import plan, run_study, write_report
    from headmix.study.runner import PARENT_DIR, PARENT_RECORD, finished_results
    from headmix.training import distill

    calls = []
    real = distill.Distiller.parent_logits
    monkeypatch.setattr(distill.Distiller, "parent_logits", lambda self, inputs: calls.append(1) or real(self, inputs))
    spec, out = _study(corpus), tmp_path / "study"
    results = {r.row: r for r in run_study(spec, out, log=lambda m: None)}
    # the distilled row's 2 training steps and its 6 timed steps (no warm-up) ran the parent; no other row did
    assert len(calls) == 2 + 6
    timing = json.loads((out / "timing" / "dense_distilled.json").read_text())
    assert timing["distill"]["temperature"] == 2.0 and "learned" not in json.dumps(timing.get("distill"))
    assert "distill" not in json.loads((out / "timing" / "learned.json").read_text())
    parent_sha = json.loads((out / PARENT_DIR / PARENT_RECORD).read_text())["sha256"]
    summary = results["dense distilled"].summary
    assert summary["distill_from"] == {"path": str((out / PARENT_DIR).resolve()), "kind": "headmix run",
                                       "sha256": {"model.safetensors": parent_sha}, "weight": 0.5, "temperature": 2.0}
    assert "distill_from" not in results["dense"].summary
    table = write_report(spec, plan(spec), finished_results(spec, out, lambda m: None), out)
    # one control, two rows it controls
    assert [(c["row"], c["control"]) for c in table["controls"]] == [("learned", "pruned"), ("dense distilled", "pruned")]
    md = (out / "results.md").read_text()
    assert "| dense distilled | the parent as it is; distilled from the parent (weight 0.5, temperature 2) |" in md


# ------------------------------------------------------------------------------------ Hugging Face Trainer
def test_distillation_lives_in_one_package_and_its_old_import_paths_give_the_same_objects():
    """:mod:`headmix.distillation` holds the loss, the parent, the loop's term and the Trainer route; the names
    once imported from ``headmix.training.distill``, ``headmix.hf`` and ``headmix.hf.distill`` are those."""
    import headmix.distillation as distillation
    import headmix.training.distill as old
    from headmix.distillation import hf_trainer, kl, loop, parent

    assert old.Distiller is distillation.Distiller is loop.Distiller
    assert old.distillation_kl is kl.distillation_kl and old.check_parent is parent.check_parent
    assert old.load_parent is parent.load_parent and old.shared_parent_identity is parent.shared_parent_identity
    pytest.importorskip("transformers")
    import headmix.hf
    import headmix.hf.distill

    assert headmix.hf.DistillationTrainer is headmix.hf.distill.DistillationTrainer is hf_trainer.DistillationTrainer
    assert headmix.hf.distillation_loss is distillation.distillation_loss is hf_trainer.distillation_loss


def test_the_trainer_route_distils_exactly_and_leaves_the_parent_unchanged(tmp_path):
    transformers = pytest.importorskip("transformers")
    from headmix.hf import DistillationTrainer, HeadmixConfig, HeadmixForCausalLM, distillation_loss

    torch.manual_seed(0)
    config = get_config("llama-tiny-moh", task="lm", vocab_size=VOCAB)
    student = HeadmixForCausalLM(HeadmixConfig(headmix=config))
    parent = HeadmixForCausalLM(HeadmixConfig(headmix=config.replace(dropout=0.2)))
    before = {k: v.clone() for k, v in parent.state_dict().items()}
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 6:] = -100  # e.g. padding the collator left out
    mask = torch.ones_like(ids)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                          learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, seed=0, gradient_accumulation_steps=2)
    data = [{"input_ids": ids[i], "labels": labels[i], "attention_mask": mask[i]} for i in range(2)] * 4
    trainer = DistillationTrainer(model=student, args=args, train_dataset=data, parent_model=parent,
                                  distill_weight=0.6, distill_temperature=1.5)
    # the loss of one batch against the hand-written one: CE over the next labels, KL over the same positions
    out = student(ids, attention_mask=mask, labels=labels)
    loss = trainer.compute_loss(student, {"input_ids": ids, "labels": labels, "attention_mask": mask})
    with torch.no_grad():
        parent_logits = parent.eval()(ids, attention_mask=mask).logits
    scored = labels[:, 1:] != -100
    kl = reference_kl(out.logits[:, :-1].detach(), parent_logits[:, :-1], scored, 1.5)
    expected = 0.4 * out.lm_loss.double() + 0.6 * 1.5 ** 2 * kl + out.aux_loss.double()
    torch.testing.assert_close(loss.detach().double(), expected, rtol=1e-5, atol=0)
    assert distillation_loss(out, parent_logits, labels, weight=0.0)[0].item() == pytest.approx(out.loss.item(), rel=1e-6)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert not parent.training and all(p.grad is None and not p.requires_grad for p in parent.parameters())
    assert all(torch.equal(v, before[k]) for k, v in parent.state_dict().items())
    with pytest.raises(ValueError, match="distill_weight must be a number in"):
        DistillationTrainer(model=student, args=args, train_dataset=data, parent_model=parent, distill_weight=2)
    other = HeadmixForCausalLM(HeadmixConfig(headmix=config.replace(vocab_size=VOCAB + 1)))
    with pytest.raises(ValueError, match=f"parent_model has a vocabulary of {VOCAB + 1}, the model {VOCAB}"):
        DistillationTrainer(model=student, args=args, train_dataset=data, parent_model=other)


# ----------------------------------------------------------------------------------------------- docs
ROOT = Path(__file__).resolve().parents[1]


def _distill_commands(doc: str) -> list[str]:
    import re

    blocks = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
              if "--distill-from runs/dense" in b]
    assert len(blocks) == 1, doc
    return [line for line in blocks[0].splitlines() if line.startswith("headmix ")]


def test_the_distilled_upcycling_commands_of_the_docs_run_as_written(corpus, tmp_path, monkeypatch, capsys):
    import shlex

    from headmix.cli.main import main

    commands = _distill_commands("docs/training.md")
    assert commands == _distill_commands("docs/hf.md") and len(commands) == 3
    shutil.copy(corpus / "docs.jsonl", tmp_path / "docs.jsonl")
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err[-2000:]
    parent_sha = sha256_file(tmp_path / "runs" / "dense" / "model.safetensors")
    for name, weight, temperature in (("moh-distilled", 0.5, 2.0), ("pruned-distilled", 0.5, 1.0)):
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["distill_from"]["sha256"] == {"model.safetensors": parent_sha}
        assert (summary["distill_from"]["weight"], summary["distill_from"]["temperature"]) == (weight, temperature)


def test_the_trainer_route_gives_the_parent_the_students_positions_on_a_packed_batch(tmp_path, monkeypatch):
    """Three documents packed in one row (position_ids restarting, as a flattening collator makes them): the parent
    is called with the student's position_ids, and its logits are those of a call given them, not those of one long
    sequence. A parent whose forward cannot take them is refused in one line."""
    transformers = pytest.importorskip("transformers")
    from headmix.hf import DistillationTrainer
    from headmix.distillation import hf_trainer as hf_distill

    def llama(seed):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(config).double()

    student, parent = llama(0), llama(1)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    labels = ids.clone()
    labels[0, [5, 8]] = -100  # a document's first token is not predicted from the one before
    seen = []
    real = hf_distill.distillation_loss
    monkeypatch.setattr(hf_distill, "distillation_loss",
                        lambda outputs, parent_logits, *a, **k: seen.append(parent_logits) or real(outputs, parent_logits,
                                                                                                   *a, **k))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    trainer = DistillationTrainer(model=student, args=args, train_dataset=[{"input_ids": ids[0]}], parent_model=parent)
    loss = trainer.compute_loss(student, {"input_ids": ids, "labels": labels, "position_ids": positions})
    with torch.no_grad():
        packed = parent(ids, position_ids=positions).logits
        one_sequence = parent(ids).logits
    assert torch.equal(seen[0], packed) and not torch.allclose(packed, one_sequence)
    assert torch.isfinite(loss)

    class NoPositions(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            raise AssertionError("not called")

    with pytest.raises(ValueError, match=r"^parent_model.forward takes no position_ids, which the batch gives the "
                                         r"model: the parent must see what the student sees"):
        hf_distill.parent_inputs(NoPositions(), {"input_ids": ids, "labels": labels, "position_ids": positions})


# ------------------------------------------------------------------------ TRL and Liger Kernel, on the same batch
def _trl_generalized_jsd_loss():
    """TRL's ``GKDTrainer.generalized_jsd_loss`` (a static method), taken from its source: importing the trainer's
    module needs ``datasets``, which the loss does not."""
    import ast
    import importlib.util
    import textwrap

    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("trl is not installed (docs/training.md: how to compare)")
    source = (Path(spec.origin).parent / "experimental" / "gkd" / "gkd_trainer.py").read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)
                and n.name == "generalized_jsd_loss")
    namespace = {"torch": torch, "F": F}
    exec(textwrap.dedent(ast.get_source_segment(source, node)), namespace)
    return namespace["generalized_jsd_loss"]


def test_the_kl_and_loss_equal_trls_gkd_loss_and_liger_kernels_fused_jsd_on_the_same_batch():
    """An optional oracle (skipped without the peers; run with PYTHONPATH=.peers, docs/training.md): on the same
    batch, headmix's KL equals TRL's GKD loss at beta 0 (KL(parent || student) per scored token, no T^2) and Liger
    Kernel's fused-linear JSD loss at beta 0 (its soft loss); the student's gradients agree too; and Liger's hard +
    soft mix is headmix's loss with the T^2 written into the soft weight."""
    trl_loss = _trl_generalized_jsd_loss()
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    from headmix.hf.distill import distillation_loss

    g = torch.Generator().manual_seed(7)
    batch, time, d, t, w = 2, 9, 8, 2.0, 0.3
    hidden = torch.randn(batch, time, d, dtype=torch.float64, generator=g)
    student_head = torch.randn(VOCAB, d, dtype=torch.float64, generator=g)
    parent_hidden = torch.randn(batch, time, d, dtype=torch.float64, generator=g)
    parent_head = torch.randn(VOCAB, d, dtype=torch.float64, generator=g)
    labels = torch.randint(0, VOCAB, (batch, time), generator=g)
    labels[1, 5:] = -100
    parent_logits = parent_hidden @ parent_head.T

    def ours(head):
        logits = hidden @ head.T
        task = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return distillation_loss(SimpleNamespace(logits=logits, loss=task), parent_logits, labels, weight=w,
                                 temperature=t)

    head = student_head.clone().requires_grad_()
    loss, kl = ours(head)
    # TRL: shifted logits and labels, as GKDTrainer.compute_loss passes them
    head_trl = student_head.clone().requires_grad_()
    gkd = trl_loss((hidden @ head_trl.T)[:, :-1], parent_logits[:, :-1], labels=labels[:, 1:], beta=0.0,
                   temperature=t)
    torch.testing.assert_close(kl, gkd.detach(), rtol=0, atol=1e-6)
    # Liger: the fused linear layer, flattened shifted positions, soft loss alone and the mix
    fused = liger.LigerFusedLinearJSDLoss(weight_hard_loss=1 - w, weight_soft_loss=w * t * t, beta=0.0,
                                          temperature=t, compiled=False, chunk_size=5, return_soft_hard_loss=True)
    head_liger = student_head.clone().requires_grad_()
    mixed, soft, _ = fused(hidden[:, :-1].reshape(-1, d), head_liger, parent_hidden[:, :-1].reshape(-1, d),
                              parent_head, labels[:, 1:].reshape(-1))
    torch.testing.assert_close(kl, soft.detach().to(kl.dtype), rtol=0, atol=1e-6)
    torch.testing.assert_close(loss.detach(), mixed.detach().to(loss.dtype), rtol=0, atol=1e-6)
    # gradients of the mixed losses with respect to the student's output layer
    ours_grad, = torch.autograd.grad(ours(head)[0], head)
    liger_grad, = torch.autograd.grad(mixed, head_liger)
    torch.testing.assert_close(ours_grad, liger_grad.to(ours_grad.dtype), rtol=0, atol=1e-6)
    trl_grad, = torch.autograd.grad(gkd, head_trl)
    kl_grad, = torch.autograd.grad(distillation_kl(hidden @ head.T, parent_logits,
                                                   torch.cat([labels[:, 1:] != -100,
                                                              torch.zeros(batch, 1, dtype=torch.bool)], 1), t), head)
    torch.testing.assert_close(kl_grad, trl_grad, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_distill_bench_runs_at_tiny_sizes_and_refuses_a_bad_size_in_one_line(capsys):
    from headmix.cli.main import main

    assert main(["bench", "distill", "--vocab", "300", "--batch", "2", "--length", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 300 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 9 and all(float(c) > 0 for c in cells)
    assert main(["bench", "distill", "--vocab", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--vocab must be >= 1, got [0]" in err and len(err.splitlines()) == 1
