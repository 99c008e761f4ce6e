"""The model implementations (Llama family, MoE, MLA) and their loading; `registry` picks one by
the checkpoint's `architectures` name."""
