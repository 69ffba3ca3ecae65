"""Models and their files: nn.Module plumbing and the formats models come in (PEFT LoRA
adapters: :mod:`featcal.model.lora`; the hub-style export: :mod:`featcal.model.export`)."""
