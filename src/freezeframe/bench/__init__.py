"""``freezeframe bench``: the reference Llama under eager, torch.compile and freezeframe modes."""
