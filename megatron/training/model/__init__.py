"""The model: megatron-core's GPTModel with USP attention, its layer spec and the fused loss.

:mod:`.build` (the model of ``pretrain_gpt.py`` in DDP), :mod:`.layer_specs` (the layer and
block specs with USP core attention), :mod:`.gpt_model` (rotary embedding from the batch's
position ids), :mod:`.fused_loss` and :mod:`.fused_loss_model` (output layer and loss fused
over chunks of tokens).
"""
