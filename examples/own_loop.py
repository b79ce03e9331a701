"""gradstep inside your own training loop, in ~30 lines.

Trains the demo GPT on a few standard-library files with 4 micro-batches of 8 sequences
per optimizer step and fixed norm clipping. Run:

    .venv/bin/python examples/own_loop.py
"""

import torch

import gradstep
from gradstep_cli.data.sources import TrainBatches, load_corpus
from gradstep_cli.models.gpt import GPT, GPTConfig

torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, d_model=128))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
stepper = gradstep.Stepper(
    model, optimizer, scheduler=scheduler, clip=gradstep.ClipNorm(1.0), precision="fp32"
)


def loss_fn(model, batch):
    # Return the SUM of per-token losses and the token count; gradstep divides once,
    # by the count over the whole window (and over every rank).
    return gradstep.token_loss(model(batch["input_ids"]), batch["labels"])


corpus = load_corpus(max_bytes=300_000)
stream = TrainBatches(corpus.train, seq_len=64, micro_batch_size=8, seed=0)
for window in gradstep.windows(stream, 4):
    stats = stepper.step(window, loss_fn)
    print(
        f"step {stats.step:3d}  loss {stats.loss:.3f}  items {stats.items}  "
        f"grad norm (pre-clip) {stats.grad_norm:.2f}  clipped {stats.clipped}"
    )
    if stats.step == 30:
        break
