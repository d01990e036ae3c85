"""Triton kernels, installed as ``megatron_subq.kernels`` (one folder per op).

Each op folder holds its forward/backward/decode kernels and one ``torch.autograd.Function``;
``megatron_subq.ops.<op>`` dispatches to it on CUDA (or under ``TRITON_INTERPRET=1``) and tests
compare it against the op's PyTorch reference.
"""
