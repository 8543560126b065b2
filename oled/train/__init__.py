"""Training a small LLaDA2-architecture MoE diffusion LM (the engine's default model) without downloads.

Pipeline: ``corpus.build_corpus`` (Python standard library sources -> train/held-out text, manifest, BPE tokenizer,
token ids) -> ``tiny.main`` (block-diffusion training, time-bounded) -> ``checkpoint.save_checkpoint`` (official
LLaDA2 Hugging Face layout) -> ``evaluate.heldout_metrics``.
"""
