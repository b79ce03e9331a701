"""The models a run trains: :mod:`.gpt` (the default byte-level GPT, "the demo"),
:mod:`.hf` (a Hugging Face causal LM from ``--model hf:DIR``), :mod:`.lora` (PEFT LoRA on
it), :mod:`.spec` (the model stage: the run's model, resolved once) and
:mod:`.parallel_plan` (``--strategy``, ``--tp``, ``--hsdp``: how the model is laid over the
ranks)."""
