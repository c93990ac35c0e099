"""LoRA adapters over one base model, many in one step (the punica / S-LoRA way): each
adapted projection holds every resident adapter's A and B stacked by slot, and a step's
rows name their slot, so rows of different adapters and of none run in one batch with no
weights merged. adapter.py reads PEFT folders; bank.py holds the slots."""
