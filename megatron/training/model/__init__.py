"""The model: megatron-core's GPTModel with USP attention, its layer spec and the fused loss."""
