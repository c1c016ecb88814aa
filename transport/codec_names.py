"""Codec names, apart from the codecs themselves so that importing them costs no torch.

The control socket's clients (`swarmctl`) speak RPC without tensors and should start in a blink;
torch is imported only by code that actually encodes or decodes a tensor.
"""

CODECS = ("none", "fp16", "lz4", "fp16+lz4", "int8")
# Activations and gradients tolerate fp16; lz4 is kept only where a sample shows it pays.
DEFAULT_CODEC = "fp16+lz4"
