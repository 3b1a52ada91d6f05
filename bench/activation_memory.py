"""Activation memory with and without per-layer gradient checkpointing.

Counts the bytes autograd keeps between forward and backward
(`xla_fsdp.memory.saved_activations.saved_activation_bytes`) for one forward of a
GPT-2 (default d 256, 4 layers, vocab 8192, seq 128, batch 8), as a plain
model and wrapped with xla_fsdp (XLA:CPU, world size 1, units on GPT2Block),
each with and without checkpointing every block. Parameters gathered by a
resharding unit are not counted: the engine keeps tokens for them, not tensors.

    PJRT_DEVICE=CPU python bench/activation_memory.py [--n_embd 256 --n_layer 4 --seq 128 --batch 8]
"""
import argparse

import torch


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_embd // 64,
                     vocab_size=args.vocab, n_positions=args.seq)
    return GPT2LMHeadModel(cfg)


def measure(args, fsdp: bool, ckpt: bool) -> int:
    import xla_fsdp
    from xla_fsdp.memory.saved_activations import saved_activation_bytes

    model = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    if fsdp:
        import torch_xla

        model = xla_fsdp.FSDP(model, auto_wrap_policy=xla_fsdp.wrap.transformer_policy(["GPT2Block"]),
                              activation_checkpointing=ckpt)
        ids = ids.to(torch_xla.device())
    elif ckpt:
        for block in model.transformer.h:
            xla_fsdp.checkpoint_module(block)
    with saved_activation_bytes() as stats:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return stats["bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=256)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    import torch_xla

    torch_xla.device()  # start XLA before autograd's first backward (see README, troubleshooting)
    print(f"GPT-2 d{args.n_embd} L{args.n_layer} vocab {args.vocab}, batch {args.batch} x seq {args.seq}")
    print(f"{'setup':32s} {'saved MiB':>10s} {'vs plain':>9s}")
    rows = [("plain", False, False), ("plain + checkpoint", False, True),
            ("xla_fsdp (XLA, world 1)", True, False), ("xla_fsdp + checkpoint", True, True)]
    base = None
    for label, fsdp, ckpt in rows:
        b = measure(args, fsdp, ckpt)
        base = base or b
        print(f"{label:32s} {b / 2**20:>10.1f} {b / base:>9.2f}")


if __name__ == "__main__":
    main()
