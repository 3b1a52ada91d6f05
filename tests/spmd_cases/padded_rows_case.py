"""The SPMD engine's padded rows ([Note: padded rows]) through checkpoints and save_pretrained.

A tiny GPT-2 with a 120-token vocabulary over 8 virtual devices: its tied embedding is stored as
128 rows. Trained with AdamW, saved as a sharded checkpoint and with `save_pretrained`; the
checkpoint resumes into a fresh wrapped model, and the saved directory loads into a plain
`GPT2LMHeadModel` (120 rows) that computes the same loss. Prints one RESULT line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch_xla.runtime as xr

xr.use_spmd()
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

import torch  # noqa: E402
import torch_xla  # noqa: E402

import models  # noqa: E402
import xla_fsdp  # noqa: E402
from xla_fsdp.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

VOCAB = 120


def wrapped(seed: int):
    model = models.build_gpt2(seed, vocab=VOCAB)
    model = xla_fsdp.XlaFullyShardedDataParallel(model, engine="spmd", auto_wrap_policy=models.gpt2_policy())
    return model, torch.optim.AdamW(model.parameters(), lr=models.LR)


def step(model, opt, batch) -> float:
    ids, labels = (t.to(torch_xla.device()) for t in batch)
    opt.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    torch_xla.sync()
    return loss.item()


def main() -> None:
    batches = models.gpt2_batches(4, vocab=VOCAB)
    tmp = tempfile.mkdtemp()
    model, opt = wrapped(0)
    stored = tuple(model.transformer.wte.weight.shape)
    for batch in batches[:2]:
        step(model, opt, batch)
    save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, step=2)
    # as Hugging Face's Trainer saves on XLA: the state dict on the host
    model.save_pretrained(
        os.path.join(tmp, "hf"), state_dict={k: v.detach().cpu() for k, v in model.state_dict().items()}
    )
    ids, labels = batches[3]
    with torch.no_grad():  # the saved model's loss on a batch it has not seen
        wrapped_loss = float(
            model(input_ids=ids.to(torch_xla.device()), labels=labels.to(torch_xla.device())).loss.cpu()
        )
    saved_wte = model.state_dict()["transformer.wte.weight"].detach().cpu()

    resumed, opt2 = wrapped(7)
    load_checkpoint(os.path.join(tmp, "ckpt"), resumed, opt2)
    want = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    got = {k: v.detach().cpu() for k, v in resumed.state_dict().items()}
    resume_diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    after = [step(model, opt, batches[2]), step(resumed, opt2, batches[2])]

    from transformers import GPT2LMHeadModel

    plain = GPT2LMHeadModel.from_pretrained(os.path.join(tmp, "hf"))
    with torch.no_grad():
        plain_loss = float(plain(input_ids=ids, labels=labels).loss)
    saved_diff = float((plain.transformer.wte.weight.detach() - saved_wte).abs().max())
    print(
        "RESULT "
        + json.dumps(
            {
                "stored_shape": list(stored),
                "state_shape": list(want["transformer.wte.weight"].shape),
                "pretrained_shape": list(plain.transformer.wte.weight.shape),
                "resume_diff": resume_diff,
                "losses_after_resume": after,
                "plain_loss": plain_loss,
                "wrapped_loss": wrapped_loss,
                "saved_diff": saved_diff,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
