"""Triton kernels, installed as ``megatron_subq.kernels`` (one folder per op): the bottom layer.

It imports nothing of ``megatron_subq``; the ops import it. Triton-free, for both sides:
``checks`` (input and ``cu_seqlens`` checks), ``powers`` (exact integer powers), ``lazy``
(first-use loading of the Triton modules), and per op
``plan`` (PPA's offsets, Superlinear's geometry) or ``state`` (decode-state types). Each op folder
holds its forward/backward/decode kernels, a frozen ``LaunchConfig`` and one
``torch.autograd.Function`` (``function.py``, loaded on first use; Superlinear splits its host
code by concern); ``megatron_subq.ops.<op>`` dispatches to it on CUDA (or under
``TRITON_INTERPRET=1``) and tests compare it against the op's PyTorch reference.
"""
