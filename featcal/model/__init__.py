"""nn.Module and file plumbing: where a model's blocks are (arch), hooks on a block's inputs (capture),
hidden states moved block by block (streams), eval mode, input checks (validate), base and experts
loaded from files (loading), model directories read and written tensor by tensor (checkpoints), PEFT
LoRA adapters merged into experts (lora), the files a hub expects beside a model (export).

Imports util and config only."""
