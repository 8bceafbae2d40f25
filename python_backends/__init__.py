"""zipmoe: multi-image QA over a Qwen3-VL-MoE model on Triton Inference Server."""
