"""Compiled CPU kernels (C++ under ``csrc/``), each with a pure-PyTorch twin at its call site."""
